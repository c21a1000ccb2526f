"""Export a step to a .safetensors file and import one as a new step.

safetensors is an optional extra (``pip install 'cnrstore[safetensors]'``): it is imported
only here, and its absence is a clear MissingExtra error, not an ImportError traceback.
An export carries what a later import needs to reproduce the step: the step's user
metadata and each table's scheme, in the file's string-to-string metadata under the keys
``cnrstore.*``. Tensors of a lossy scheme are exported as their restored values (the
dtype and shape they were put with), so the file is readable by any safetensors reader.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from cnrstore.errors import (
    BadPath,
    InvalidInput,
    InvalidType,
    MissingExtra,
    StorageError,
    translating,
)
from cnrstore.format.load import load_step, load_table
from cnrstore.tools.access import tick
from engine import atomic_write

__all__ = ["MissingExtra", "TransferResult", "export_step", "export_target",
           "import_step"]

_KEY_STEP = "cnrstore.step"
_KEY_METADATA = "cnrstore.metadata"
_KEY_SCHEMES = "cnrstore.schemes"


@dataclass(frozen=True)
class TransferResult:
    direction: str            # "export" or "import"
    step: int
    path: str
    tables: tuple[str, ...]
    logical_bytes: int        # the tensors' bytes
    schemes: dict             # name -> scheme (as stored, or as imported)
    bytes_written: int        # file bytes (export) or record bytes written to the store


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as exc:
        raise MissingExtra(
            "export/import need the optional package safetensors: "
            "pip install 'cnrstore[safetensors]'"
        ) from exc
    return st


def _check_store(store) -> None:
    from cnrstore.core.store import CheckpointStore

    if not isinstance(store, CheckpointStore):
        raise InvalidType(f"expected an open CheckpointStore (cnrstore.open(path)), got "
                          f"{type(store).__name__}")


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def export_target(path: str | os.PathLike, *, overwrite: bool,
                  flag: str = "overwrite=True") -> str:
    """The file an export to ``path`` writes, checked before anything is read or written:
    its directory exists, and ``path`` is new or (with ``overwrite``) a regular file. A
    symlink is followed: its target is replaced and the link stays. Anything else (a
    device such as /dev/null, a FIFO, a directory) is BadPath even with ``overwrite``: the
    export renames a new file over the target, which would replace the device itself.
    ``flag`` is how the caller spells ``overwrite`` in the message (the CLI's --force)."""
    given = os.fspath(path)
    target = os.path.realpath(given)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        if os.path.islink(given):
            raise BadPath(f"{given!r} is a symlink to the missing {target!r}", path=given) \
                from None
        parent = os.path.dirname(target)
        if not os.path.isdir(parent):
            raise BadPath(f"cannot export to {given!r}: directory {parent!r} does not exist",
                          path=given) from None
        return target
    except OSError as exc:
        raise BadPath(f"cannot export to {given!r}: {exc.strerror or exc}", path=given) \
            from exc
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise BadPath(f"{given!r} is {kind}; export writes only regular files (give a "
                      "file name)", path=given)
    if not overwrite:
        raise BadPath(f"{given!r} exists; remove it or pass {flag}", path=given)
    return target


def _write_file(target: str, given: str, data: bytes) -> None:
    """``data`` as the file ``target``, complete or not at all: a temporary file in the
    same directory, fsync'ed and renamed over it (engine.atomic_write, which removes
    the temporary file when a write fails). A full disk or any other OSError is
    StorageError naming the file; an existing file is then left as it was."""
    existed = os.path.exists(target)
    try:
        atomic_write(target, data)
    except OSError as exc:
        kept = f"; {given!r} is unchanged" if existed else ""
        raise StorageError(f"cannot write {given!r}: {exc.strerror or exc}; nothing was "
                           f"written{kept}") from exc


@translating
def export_step(store, step: int, path: str | os.PathLike, *,
                names: Iterable[str] | None = None, overwrite: bool = False,
                progress=None) -> TransferResult:
    """Write the tables of ``step`` (all, or ``names``) to the safetensors file ``path``.

    The file appears complete or not at all (a temporary file, fsync'ed, renamed). An
    existing ``path`` is BadPath unless ``overwrite``; only a regular file is ever
    replaced (``export_target``)."""
    _check_store(store)
    st = _safetensors()
    given = os.fspath(path)
    target = export_target(given, overwrite=overwrite)
    _, node = load_step(store.objects, step)
    wanted = list(node.tables) if names is None else list(dict.fromkeys(names))
    tables = store.get_tables(step, names=wanted)
    by_name = dict(zip(node.tables, node.table_ids))
    schemes = {n: load_table(store.objects, by_name[n]).scheme for n in wanted}
    meta = {
        _KEY_STEP: str(step),
        _KEY_METADATA: json.dumps(node.metadata, sort_keys=True, default=str),
        _KEY_SCHEMES: json.dumps(schemes, sort_keys=True),
    }
    # safetensors refuses views sharing storage and non-contiguous tensors.
    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in tables.items()}
    tick(progress, 1, 2)
    data = st.save(tensors, metadata=meta)
    _write_file(target, given, data)
    tick(progress, 2, 2)
    logical = sum(t.numel() * t.element_size() for t in tensors.values())
    return TransferResult("export", step, given, tuple(tensors), logical, schemes, len(data))


def _file_metadata(path: str) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


def _json_object(path: str, meta: dict[str, str], key: str) -> dict:
    """The JSON object under ``key`` of a file's metadata ({} when absent); anything else
    (bad JSON, a list, a number) is InvalidInput, before the store is touched."""
    try:
        value = json.loads(meta.get(key, "{}"))
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{path!r} has malformed cnrstore metadata: {key} is not JSON "
                           f"({exc})") from exc
    if not isinstance(value, dict):
        raise InvalidInput(f"{path!r} has malformed cnrstore metadata: {key} is a JSON "
                           f"{type(value).__name__}, not an object")
    return value


def _schemes(quant, tensors: dict, stored: dict) -> dict[str, str]:
    if quant is None:
        return {n: stored.get(n, "exact") for n in tensors}
    if isinstance(quant, str):
        quant = {"*float": quant}
    unknown = sorted(set(quant) - set(tensors) - {"*float"})
    if unknown:
        raise InvalidInput(f"quant names {unknown[0]!r}, which the file does not hold")
    default = quant.get("*float", "exact")
    return {n: quant.get(n, default if t.is_floating_point() else "exact")
            for n, t in tensors.items()}


@translating
def import_step(store, step: int, path: str | os.PathLike, *, quant=None,
                progress=None) -> TransferResult:
    """Store the tensors of the safetensors file ``path`` as ``step``.

    ``quant``: None uses the schemes recorded by ``export_step`` (``exact`` for files from
    elsewhere); one scheme applies to the floating-point tensors (integer and bool tensors
    stay exact, the only scheme they take); a mapping names schemes per tensor, with the
    key ``"*float"`` for the floating-point tensors it does not name. The step's metadata
    is the exported one, if any.
    The store validates everything before writing (an existing step is an error)."""
    st = _safetensors()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise BadPath(f"no file {path!r}", path=path)
    try:
        meta = _file_metadata(path)
        tensors = st.load_file(path)
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise InvalidInput(f"{path!r} is not a readable safetensors file: {exc}") from exc
    if not tensors:
        raise InvalidInput(f"{path!r} holds no tensors")
    tick(progress, 1, 2)
    metadata = _json_object(path, meta, _KEY_METADATA)
    stored_schemes = _json_object(path, meta, _KEY_SCHEMES)
    bad = next((k for k, v in stored_schemes.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise InvalidInput(f"{path!r} has malformed cnrstore metadata: {_KEY_SCHEMES} maps "
                           f"{bad!r} to {stored_schemes[bad]!r}, not a scheme name (pass "
                           "--quant / quant= to choose the schemes)")
    quant = _schemes(quant, tensors, stored_schemes)
    info = store.put_tables(step, tensors, quant=quant, metadata=metadata)
    tick(progress, 2, 2)
    # Read the schemes back: "auto" and "*" resolve inside put_tables.
    _, node = load_step(store.objects, step)
    schemes = {n: load_table(store.objects, t).scheme
               for n, t in zip(node.tables, node.table_ids)}
    return TransferResult("import", step, path, tuple(tensors), info.logical_bytes, schemes,
                          info.bytes_written)

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
from collections.abc import Iterable
from dataclasses import dataclass

from cnrstore.errors import BadPath, InvalidInput, InvalidType, MissingExtra, translating
from cnrstore.format.manifest import load_step, load_table
from cnrstore.tools.access import tick
from engine.fileio import atomic_write

__all__ = ["MissingExtra", "TransferResult", "export_step", "import_step"]

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


@translating
def export_step(store, step: int, path: str | os.PathLike, *,
                names: Iterable[str] | None = None, overwrite: bool = False,
                progress=None) -> TransferResult:
    """Write the tables of ``step`` (all, or ``names``) to the safetensors file ``path``.

    The file appears complete or not at all (engine.fileio.atomic_write: a temporary file,
    fsync'ed, renamed). An existing ``path`` is BadPath unless ``overwrite``."""
    _check_store(store)
    st = _safetensors()
    path = os.fspath(path)
    if os.path.isdir(path):
        raise BadPath(f"{path!r} is a directory; give a file name", path=path)
    if os.path.exists(path) and not overwrite:
        raise BadPath(f"{path!r} exists; remove it or pass overwrite", path=path)
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
    atomic_write(path, st.save(tensors, metadata=meta))
    tick(progress, 2, 2)
    logical = sum(t.numel() * t.element_size() for t in tensors.values())
    return TransferResult("export", step, path, tuple(tensors), logical, schemes,
                          os.path.getsize(path))


def _file_metadata(path: str) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return dict(f.metadata() or {})


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
    try:
        metadata = json.loads(meta.get(_KEY_METADATA, "{}"))
        stored_schemes = json.loads(meta.get(_KEY_SCHEMES, "{}"))
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{path!r} has malformed cnrstore metadata: {exc}") from exc
    quant = _schemes(quant, tensors, stored_schemes)
    info = store.put_tables(step, tensors, quant=quant, metadata=metadata)
    tick(progress, 2, 2)
    # Read the schemes back: "auto" and "*" resolve inside put_tables.
    _, node = load_step(store.objects, step)
    schemes = {n: load_table(store.objects, t).scheme
               for n, t in zip(node.tables, node.table_ids)}
    return TransferResult("import", step, path, tuple(tensors), info.logical_bytes, schemes,
                          info.bytes_written)

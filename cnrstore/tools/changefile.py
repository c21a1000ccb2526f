"""The changes between two steps as one .safetensors file a serving job reads without
cnrstore (docs/GUIDE.md, "Publishing changes"), and their replay onto a replica file.

Layout: per table with changed rows the tensors ``rows/<table>`` (int64 [n], ascending
global row ids of step B) and ``values/<table>`` ([n, *row shape], the dtype of step B,
values as ``get_tables(B)`` returns them). Table names may hold "/" and "."; the key
splits at its first "/". The file's string metadata holds, under ``cnrstore.changes``, a
JSON document::

    {"v": 1, "a": A, "b": B,
     "tables": {name: {"kind": "rows" | "added" | "dropped" | "reshaped",
                       "shape": [rows, ...] | null,     # in step B; null when dropped
                       "dtype": "float32" | ... | null,
                       "scheme_a": str | null, "scheme_b": str | null}}}

and ``cnrstore.a``, ``cnrstore.b`` (the steps, decimal) and ``cnrstore.schemes`` (JSON:
name -> [scheme in A, scheme in B]). A table absent from "tables" did not change.
Replaying: drop "dropped" tables; for "added" and "reshaped" make a zero tensor of
``shape`` and ``dtype`` keeping the rows both shapes share when dtype and row shape are
unchanged; then ``table[rows] = values``. ``apply_changes`` does exactly that.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

from cnrstore.errors import BadPath, InvalidInput, MissingExtra, translating
from cnrstore.format.load import load_step, load_table
from engine import atomic_write

__all__ = ["ChangesFile", "apply_changes", "apply_file", "read_changes", "write_changes"]

KEY = "cnrstore.changes"
_VERSION = 1


@dataclass(frozen=True)
class ChangesFile:
    a: int
    b: int
    path: str
    tables: dict              # name -> kind
    rows: int                 # rows carried, all tables
    bytes_written: int        # file bytes

    def text(self) -> str:
        lines = [f"changes {self.a} -> {self.b}: {len(self.tables)} tables, "
                 f"{self.rows} rows, {self.bytes_written} bytes in {self.path}"]
        lines += [f"  {kind:9} {name}" for name, kind in self.tables.items()]
        return "\n".join(lines)


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as exc:
        raise MissingExtra("changes files need the optional package safetensors: "
                           "pip install 'cnrstore[safetensors]'") from exc
    return st


def _schemes(objects, step: int) -> dict[str, str]:
    _, node = load_step(objects, step)
    return {n: load_table(objects, t).scheme for n, t in zip(node.tables, node.table_ids)}


@translating
def write_changes(store, a: int, b: int, path: str | os.PathLike, *,
                  names: Iterable[str] | None = None, overwrite: bool = False,
                  strict: bool = False) -> ChangesFile:
    """Write ``store.changes(a, b, names)`` to the safetensors file ``path`` (complete or
    not at all; an existing file is BadPath unless ``overwrite``)."""
    import torch

    st = _safetensors()
    path = os.fspath(path)
    if os.path.isdir(path):
        raise BadPath(f"{path!r} is a directory; give a file name", path=path)
    if os.path.exists(path) and not overwrite:
        raise BadPath(f"{path!r} exists; remove it or pass overwrite", path=path)
    changes = store.changes(a, b, names, strict=strict)   # checks the request first
    schemes_a, schemes_b = _schemes(store.objects, a), _schemes(store.objects, b)
    head: dict[str, dict] = {}
    rows: dict[str, list] = {}
    values: dict[str, list] = {}
    for ch in changes:
        entry = head.setdefault(ch.table, {"kind": "rows"})
        if ch.kind != "rows":
            entry["kind"] = ch.kind
        entry["shape"] = list(ch.shape) if ch.shape is not None else None
        entry["dtype"] = str(ch.dtype).removeprefix("torch.") if ch.dtype else None
        entry["scheme_a"] = schemes_a.get(ch.table)
        entry["scheme_b"] = schemes_b.get(ch.table)
        if len(ch.rows):
            rows.setdefault(ch.table, []).append(ch.rows)
            values.setdefault(ch.table, []).append(ch.values)
    tensors = {}
    for name in rows:
        tensors[f"rows/{name}"] = torch.cat(rows[name]).contiguous()
        tensors[f"values/{name}"] = torch.cat(values[name]).contiguous()
    doc = {"v": _VERSION, "a": a, "b": b, "tables": head}
    meta = {KEY: json.dumps(doc, sort_keys=True), "cnrstore.a": str(a), "cnrstore.b": str(b),
            "cnrstore.schemes": json.dumps({n: [schemes_a.get(n), schemes_b.get(n)]
                                            for n in head}, sort_keys=True)}
    atomic_write(path, st.save(tensors, metadata=meta))
    n = sum(len(t) for k, t in tensors.items() if k.startswith("rows/"))
    return ChangesFile(a, b, path, {k: v["kind"] for k, v in head.items()}, n,
                       os.path.getsize(path))


def read_changes(path: str | os.PathLike) -> tuple[dict, dict]:
    """(the header document, the tensors) of a changes file; InvalidInput if it is not
    one."""
    st = _safetensors()
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise BadPath(f"no file {path!r}", path=path)
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
        tensors = st.load_file(path)
        doc = json.loads(meta[KEY])
    except KeyError:
        raise InvalidInput(f"{path!r} is not a changes file (no {KEY} metadata)") from None
    except Exception as exc:  # safetensors' own errors, OSError, JSONDecodeError
        raise InvalidInput(f"{path!r} is not a readable changes file: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("v") != _VERSION or not isinstance(
            doc.get("tables"), dict):
        raise InvalidInput(f"{path!r}: unknown changes file version {doc.get('v')!r}")
    return doc, tensors


def apply_changes(doc: dict, tensors: dict, tables: MutableMapping) -> None:
    """Replay a changes file (``read_changes``) onto ``tables`` (name -> tensor, step A),
    in place; every table the file names is checked before any is written."""
    import torch

    from cnrstore.core.changes import Change
    from cnrstore.format.manifest import parse_dtype

    todo = []
    for name, t in doc["tables"].items():
        kind = t.get("kind")
        if kind not in ("rows", "added", "dropped", "reshaped"):
            raise InvalidInput(f"changes file: table {name!r} has unknown kind {kind!r}")
        rows = tensors.get(f"rows/{name}", torch.empty(0, dtype=torch.int64))
        dtype = parse_dtype(t["dtype"]) if t.get("dtype") else None
        shape = tuple(t["shape"]) if t.get("shape") is not None else None
        values = tensors.get(f"values/{name}")
        if kind == "rows" and name not in tables:
            raise InvalidInput(f"changes file changes rows of {name!r}, which the replica "
                               "does not hold (is it a replica of step a?)")
        if values is None:
            values = torch.empty((0, *(shape or (0,))[1:]), dtype=dtype or torch.float32)
        base = tables.get(name) if kind == "rows" else None
        if base is not None and (len(rows) and int(rows.max()) >= base.shape[0]
                                 or tuple(values.shape[1:]) != tuple(base.shape[1:])):
            raise InvalidInput(f"changes file does not fit the replica's {name!r} "
                               f"{tuple(base.shape)}")
        if kind != "rows":
            todo.append(Change(name, rows[:0], values[:0], kind, shape, dtype,
                               t.get("scheme_b")))
        if len(rows):
            todo.append(Change(name, rows, values, "rows", shape, dtype, t.get("scheme_b")))
    for ch in todo:
        ch.apply(tables)


@translating
def apply_file(path: str | os.PathLike, to: str | os.PathLike) -> ChangesFile:
    """Replay the changes file ``path`` onto the safetensors replica ``to`` (a file of
    step A's tables, as ``cnrstore export`` writes it) and write it back atomically as
    step B. A replica that says it holds another step than A is refused."""
    st = _safetensors()
    from safetensors import safe_open

    doc, tensors = read_changes(path)
    to = os.fspath(to)
    if not os.path.isfile(to):
        raise BadPath(f"no replica file {to!r}", path=to)
    try:
        with safe_open(to, framework="pt") as f:
            meta = dict(f.metadata() or {})
        replica = st.load_file(to)
    except Exception as exc:
        raise InvalidInput(f"{to!r} is not a readable safetensors file: {exc}") from exc
    held = meta.get("cnrstore.step")
    if held is not None and held != str(doc["a"]):
        raise InvalidInput(f"{to!r} holds step {held}; the changes are from step "
                           f"{doc['a']} to {doc['b']}")
    apply_changes(doc, tensors, replica)
    meta["cnrstore.step"] = str(doc["b"])
    try:  # the replica's schemes (an export records them): those of step B now
        schemes = json.loads(meta.get("cnrstore.schemes", "{}"))
    except json.JSONDecodeError:
        schemes = {}
    for name, t in doc["tables"].items():
        schemes.pop(name, None)
        if t.get("scheme_b"):
            schemes[name] = t["scheme_b"]
    meta["cnrstore.schemes"] = json.dumps(schemes, sort_keys=True)
    out = {n: t.contiguous() for n, t in replica.items()}
    atomic_write(to, st.save(out, metadata=meta))
    n = sum(len(t) for k, t in tensors.items() if k.startswith("rows/"))
    return ChangesFile(doc["a"], doc["b"], to, {k: v["kind"] for k, v in doc["tables"].items()},
                       n, os.path.getsize(to))

"""The grouped layout's block list nodes (docs/design/diff-base.md, "Rows grouped by
rate"): a block version is a list node whose refs are row objects
(cnrstore/format/rowobjects.py), applied in list order (cnrstore/core/grouppolicy.py writes
them). The row-object names are re-exported here, where the layout's readers import them.

    LIST = msgpack {"v": 1, "cls": u8[k], "rows": u32[k], "step": i64[k]} (bin fields),
           refs = the k row objects in the order they apply
    LIST (delta) = msgpack {"v": 2, "drop": u32[d], "bb": u64, "cls", "rows", "step" of
           the k added objects}, refs = (base list, the k added row objects)
    either may also hold "born": i64, the step the block was last written whole: its
           row objects' rate codes are then counts of changes since, not rates (lists
           written before 2026-12-07 have none; cnrstore/core/grouppolicy.py)

A delta names a full list (never a delta: one level of base): the base's entries but the
``drop`` positions (ascending), then the k added objects, the order the writer keeps. It
saves writing a long list whole at every step; the dropped objects stay in its closure
(for gc), never read. ``bb``: the base's listed bytes, writer state a read never trusts.

A row's value is its copy in the last listed object that holds it. The step is in the
row object, so objects of different steps never share an id: a block written fresh over
a damaged object never dedups onto it. Each row's change rate at its write (rate_code)
rides with its copy, so a handle reopened on the store rebuilds exactly the writer state
of one that never closed (cnrstore/core/grouppolicy.py), and ids do not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from cnrstore.errors import ManifestError
from cnrstore.format.rowapply import apply_list
from cnrstore.format.rowobjects import (
    KIND_BLOCK_ROWS,
    ROWS_HEADER_BYTES,
    RowsHeader,
    decode_rows_object,
    encode_rows,
    max_rows_nbytes,
    rate_code,
    rate_value,
    rate_width,
    read_rows_header,
    rows_nbytes,
)
from engine import Object

__all__ = ["KIND_BLOCK_ROWS", "KIND_BLOCK_LIST", "LIST_READ_CAP", "RowsHeader", "rate_code",
           "rate_value", "rate_width", "rows_nbytes", "encode_rows", "read_rows_header",
           "decode_rows_object", "encode_list", "encode_list_delta", "decode_list", "ListEntries",
           "read_list", "plan_list", "resolve_list", "apply_list"]

KIND_BLOCK_LIST = 8
_LIST_VERSION = 1
_DELTA_VERSION = 2
_DROP_BYTES = 4              # u32 per dropped base entry
_LIST_ENTRY_BYTES = 13       # u8 class + u32 rows + i64 step, per listed object
_LIST_HEAD_BYTES = 80       # the map's keys and bin headers, "bb" and "born" (int64s)
# A listed version may read at most this many times its block's bytes (writers clean to
# ~1.5x, cnrstore/core/grouppolicy.py): a crafted list is refused from the index.
LIST_READ_CAP = 4


def encode_list(refs: tuple[bytes, ...], cls: np.ndarray, rows: np.ndarray,
                steps: np.ndarray, born: int | None = None) -> tuple[bytes, tuple[bytes, ...]]:
    """(payload, refs) of a block's list node: its row objects in the order they apply,
    with each one's class, row count and step; ``born``: the step the block was last
    written whole, where its rows carry counts of changes (None: rates)."""
    if not len(refs) == len(cls) == len(rows) == len(steps):
        raise ValueError("list entries differ in length")
    doc: dict[str, Any] = {"v": _LIST_VERSION, "cls": np.asarray(cls, dtype=np.uint8).tobytes(),
                           "rows": np.asarray(rows, dtype="<u4").tobytes(),
                           "step": np.asarray(steps, dtype="<i8").tobytes()}
    if born is not None:
        doc["born"] = int(born)
    return msgpack.packb(doc, use_bin_type=True), tuple(refs)


def encode_list_delta(base: bytes, base_nbytes: int, drop: np.ndarray,
                      refs: tuple[bytes, ...], cls: np.ndarray, rows: np.ndarray,
                      steps: np.ndarray, born: int | None = None
                      ) -> tuple[bytes, tuple[bytes, ...]]:
    """(payload, refs) of a delta list node: full list ``base`` (whose listed objects
    take ``base_nbytes``) but its entries ``drop`` (ascending), then ``refs``."""
    payload, refs = encode_list(refs, cls, rows, steps, born)
    doc = msgpack.unpackb(payload, raw=False)
    doc["v"] = _DELTA_VERSION
    doc["drop"] = np.asarray(drop, dtype="<u4").tobytes()
    doc["bb"] = int(base_nbytes)
    return msgpack.packb(doc, use_bin_type=True), (base, *refs)


def _list_cap(nrefs: int) -> int:
    return _LIST_HEAD_BYTES + _LIST_ENTRY_BYTES * nrefs


def decode_list(obj: Object, oid: bytes | None = None
                ) -> tuple[tuple[bytes, ...], np.ndarray, np.ndarray, np.ndarray]:
    """(refs, classes u8, row counts int64, steps int64) of a list node."""
    if obj.kind != KIND_BLOCK_LIST:
        raise ManifestError(f"object kind {obj.kind} is not a block list", oid=oid)
    k = len(obj.refs)
    if len(obj.payload) > _list_cap(k):
        raise ManifestError("block list payload is larger than its entries take", oid=oid)
    try:
        doc = msgpack.unpackb(obj.payload, raw=False, max_array_len=0, max_map_len=8,
                              max_str_len=16, max_bin_len=8 * k + 8)
        if not isinstance(doc, dict) or doc.get("v") != _LIST_VERSION:
            raise ValueError("bad version")
        cls = np.frombuffer(doc["cls"], dtype=np.uint8)
        rows = np.frombuffer(doc["rows"], dtype="<u4").astype(np.int64)
        steps = np.frombuffer(doc["step"], dtype="<i8").astype(np.int64)
    except Exception as exc:  # msgpack and numpy raise several unrelated types
        raise ManifestError(f"malformed block list: {exc}", oid=oid) from None
    if not len(cls) == len(rows) == len(steps) == k:
        raise ManifestError("block list entries and refs differ in length", oid=oid)
    return tuple(obj.refs), cls, rows, steps


@dataclass(frozen=True)
class ListEntries:
    """A block version's entries in the order they apply (a delta's resolved through its
    base); ``base``: the full list a delta names and its refs and listed bytes (for a
    full list, itself), ``base_nbytes`` None for a full list (its pieces tell)."""

    refs: tuple[bytes, ...]
    cls: np.ndarray
    rows: np.ndarray
    steps: np.ndarray
    base: bytes
    base_refs: tuple[bytes, ...]
    base_nbytes: int | None
    born: int | None = None   # the node's own "born" (None: its rows carry rates)


def read_list(get: Callable[[bytes], Object], oid: bytes, obj: Object | None = None
              ) -> ListEntries:
    """The entries of list node ``oid``, full or delta (its base read through ``get``).
    ManifestError when either node is malformed or a delta's base is not a full list."""
    node = get(oid) if obj is None else obj
    if node.kind != KIND_BLOCK_LIST:
        raise ManifestError(f"object kind {node.kind} is not a block list", oid=oid)
    try:
        doc = msgpack.unpackb(node.payload, raw=False, max_array_len=0, max_map_len=8,
                              max_str_len=16, max_bin_len=len(node.payload))
        delta = isinstance(doc, dict) and doc.get("v") == _DELTA_VERSION
    except Exception as exc:  # msgpack raises several unrelated types
        raise ManifestError(f"malformed block list: {exc}", oid=oid) from None
    born = doc.get("born") if isinstance(doc, dict) else None
    if born is not None and (type(born) is not int or not -(1 << 63) <= born < 1 << 63):
        raise ManifestError("block list's born step is not an int64", oid=oid)
    if not delta:
        refs, cls, rows, steps = decode_list(node, oid)
        return ListEntries(refs, cls, rows, steps, oid, refs, None, born)
    if not node.refs:
        raise ManifestError("delta block list names no base", oid=oid)
    base = node.refs[0]
    bobj = get(base)
    try:
        brefs, bcls, brows, bsteps = decode_list(bobj, base)
    except ManifestError as exc:
        raise ManifestError(f"delta block list's base {base.hex()} is not a full list: "
                            f"{exc}", oid=oid) from None
    k = len(node.refs) - 1
    if len(node.payload) > _list_cap(k) + _DROP_BYTES * len(brefs):
        raise ManifestError("block list payload is larger than its entries take", oid=oid)
    try:
        drop = np.frombuffer(doc["drop"], dtype="<u4").astype(np.int64)
        cls = np.frombuffer(doc["cls"], dtype=np.uint8)
        rows = np.frombuffer(doc["rows"], dtype="<u4").astype(np.int64)
        steps = np.frombuffer(doc["step"], dtype="<i8").astype(np.int64)
        bb = int(doc["bb"])
    except Exception as exc:  # missing keys, odd lengths, wrong types
        raise ManifestError(f"malformed block list: {exc}", oid=oid) from None
    if not len(cls) == len(rows) == len(steps) == k:
        raise ManifestError("block list entries and refs differ in length", oid=oid)
    if len(drop) and (drop[-1] >= len(brefs) or np.any(np.diff(drop) <= 0)):
        raise ManifestError("delta block list drops entries out of range or not ascending",
                            oid=oid)
    keep = np.ones(len(brefs), dtype=bool)
    keep[drop] = False
    at = np.flatnonzero(keep)
    return ListEntries(tuple(brefs[i] for i in at) + tuple(node.refs[1:]),
                       np.concatenate([bcls[at], cls]), np.concatenate([brows[at], rows]),
                       np.concatenate([bsteps[at], steps]), base, brefs, bb, born)


def plan_list(info: Callable[[bytes], Any], oid: bytes, nrows: int, row_nbytes: int) -> None:
    """``plan_chain`` for a list node: every listed object a row object of at most a
    whole block's rows, all of them together within LIST_READ_CAP block bytes, checked
    in the index before any is read. A delta (its first ref a list) counts its base's
    objects, dropped ones too: the index does not tell which are (writers write the
    list whole before base and added objects pass LIST_READ_CAP - 1 block bytes)."""
    got = info(oid)
    if got.kind != KIND_BLOCK_LIST:
        raise ManifestError(f"object {oid.hex()} is not a block list of its size", oid=oid)
    listed = tuple(got.refs)
    extra = 0
    if listed and info(listed[0]).kind == KIND_BLOCK_LIST:
        base = info(listed[0])
        if base.raw_len > _list_cap(len(base.refs)):
            raise ManifestError(f"object {listed[0].hex()} is not a block list of its size",
                                oid=listed[0])
        extra = _DROP_BYTES * len(base.refs)
        listed = tuple(base.refs) + listed[1:]
    if got.raw_len > _list_cap(len(got.refs)) + extra:
        raise ManifestError(f"object {oid.hex()} is not a block list of its size", oid=oid)
    one = max_rows_nbytes(nrows, row_nbytes)
    cap = LIST_READ_CAP * nrows * row_nbytes + len(listed) * ROWS_HEADER_BYTES
    total = 0
    for ref in listed:
        r = info(ref)
        if r.kind != KIND_BLOCK_ROWS or r.raw_len > one:
            raise ManifestError(f"object {ref.hex()} listed by block {oid.hex()} is not a "
                                f"row object of {nrows} rows", oid=ref)
        total += r.raw_len
        if total > cap:
            raise ManifestError(f"block list {oid.hex()} lists more than {cap} bytes",
                                oid=oid)


def resolve_list(get: Callable[[bytes], Object], oid: bytes, obj: Object | None = None, *,
                 out: np.ndarray | None = None,
                 get_many: Callable[[Sequence[bytes]], Sequence[Object]] | None = None
                 ) -> np.ndarray:
    """Encoded rows of the block whose version is list node ``oid``: its objects applied
    in list order (into ``out`` when given). ``get_many`` reads the listed objects
    together (the objects of the ids given, in their order: a restore's batched read,
    cnrstore/core/blockread.py); without it each is one ``get``. ManifestError when an
    object does not fit its entry or the block, or a row has no copy."""
    entries = read_list(get, oid, obj)
    if not entries.refs:
        raise ManifestError("block list is empty", oid=oid)
    parts = (get_many(entries.refs) if get_many is not None
             else [get(ref) for ref in entries.refs])
    if len(parts) != len(entries.refs):
        raise ManifestError("block list's objects were not all read", oid=oid)
    return apply_list(entries, parts, oid, out=out)  # rowapply.py

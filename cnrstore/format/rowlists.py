"""The grouped layout's payloads (docs/design/diff-base.md, "Rows grouped by rate"):
row objects and block list nodes. A block version is a list node whose refs are row
objects, applied in list order (cnrstore/core/grouppolicy.py writes them).

    ROWS = "CNRR" | version u8 | ids u8 | elem u8 | rated u8 | nrows u32 | row_nbytes u32
           | count u32 | start u32 | step i64 | cls u8 | 3 pad
           | row ids (ids 0: none, the span [start, start + count); 1/2: u16/u32 le
             ascending; 3: a bitmap of the block's rows, lsb first; 4, version 2 only:
             Elias-Fano, see _ef_encode) | rates | planes
      rates: rated 0: none (every code 255); 1: u8[count]; 2, version 2 only: lo u8 |
             width u8 | each code - lo in ``width`` bits, lsb first (width 0: all lo)

Writers write version 2: of the id encodings the smallest for the object, the rates
packed, ~1.5 bytes a row where version 1 took 3 (4.4% of an int8 row). Version 1
objects (ids 0-3, rated 0-1) read as they always did.
    LIST = msgpack {"v": 1, "cls": u8[k], "rows": u32[k], "step": i64[k]} (bin fields),
           refs = the k row objects in the order they apply
    LIST (delta) = msgpack {"v": 2, "drop": u32[d], "bb": u64, "cls", "rows", "step" of
           the k added objects}, refs = (base list, the k added row objects)

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

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from cnrstore.errors import ManifestError
from cnrstore.format.planes import PLANE_WIDTHS, check_elem, planes, unplanes
from engine import Object

__all__ = ["KIND_BLOCK_ROWS", "KIND_BLOCK_LIST", "LIST_READ_CAP", "RowsHeader", "rate_code",
           "rate_value", "rate_width", "rows_nbytes", "encode_rows", "read_rows_header",
           "decode_rows_object", "encode_list", "encode_list_delta", "decode_list", "ListEntries",
           "read_list", "plan_list", "resolve_list"]

KIND_BLOCK_ROWS = 7
KIND_BLOCK_LIST = 8
ROWS_VERSION = 2          # what writers write; version 1 still reads

_ROWS = struct.Struct("<4sBBBBIIIIqB3x")
_ROWS_MAGIC = b"CNRR"
IDS_SPAN, IDS_U16, IDS_U32, IDS_BITMAP, IDS_EF = 0, 1, 2, 3, 4
RATED_NONE, RATED_U8, RATED_PACKED = 0, 1, 2
# per version: the largest ids and rated values it has
_MAX_IDS = {1: IDS_BITMAP, 2: IDS_EF}
_MAX_RATED = {1: RATED_U8, 2: RATED_PACKED}
_LIST_VERSION = 1
_DELTA_VERSION = 2
_DROP_BYTES = 4              # u32 per dropped base entry
_LIST_ENTRY_BYTES = 13       # u8 class + u32 rows + i64 step, per listed object
_LIST_HEAD_BYTES = 64
# A listed version may read at most this many times its block's bytes (writers clean to
# ~1.5x, cnrstore/core/grouppolicy.py): a crafted list is refused from the index.
LIST_READ_CAP = 4


@dataclass(frozen=True)
class RowsHeader:
    nrows: int           # rows of the block the object belongs to
    row_nbytes: int
    count: int           # rows carried
    start: int           # first row of a span object (ids == IDS_SPAN)
    ids: int             # IDS_SPAN, IDS_U16, IDS_U32 or IDS_BITMAP
    rated: bool
    step: int
    cls: int
    elem: int
    header_size: int
    version: int = 1
    rates_at: int = 0    # payload offset of the rate codes, encoded as ``rated_mode`` says
    body_at: int = 0     # payload offset of the row planes
    rated_mode: int = RATED_NONE


def rate_code(rate: np.ndarray) -> np.ndarray:
    """u8 codes of change rates in [0, 1]: 2^(-k/16) for k in 0..254, 255 for 0 (below
    2^-15.9). Relative steps of 4.4%: far finer than the classes' thresholds."""
    r = np.asarray(rate, dtype=np.float64)
    with np.errstate(divide="ignore"):
        k = np.rint(-16.0 * np.log2(np.maximum(r, 1e-300)))
    return np.where(r > 2.0 ** (-254.5 / 16), np.clip(k, 0, 254), 255).astype(np.uint8)


def rate_value(code: np.ndarray) -> np.ndarray:
    """The rates ``rate_code`` codes stand for (float64)."""
    c = np.asarray(code).astype(np.float64)
    return np.where(c >= 255, 0.0, np.exp2(-c / 16.0))


def _ef_low_bits(nrows: int, count: int) -> int:
    """Low bits per id of an Elias-Fano code of ``count`` ids below ``nrows``."""
    return max(0, (nrows // count).bit_length() - 1) if count else 0


def _ef_upper_bits(nrows: int, count: int) -> int:
    return count + (max(nrows - 1, 0) >> _ef_low_bits(nrows, count)) + 1


def _ids_size(mode: int, nrows: int, count: int) -> int:
    if mode == IDS_SPAN:
        return 0
    if mode == IDS_BITMAP:
        return -(-nrows // 8)
    if mode == IDS_EF:
        return -(-count * _ef_low_bits(nrows, count) // 8) + -(-_ef_upper_bits(nrows, count)
                                                               // 8)
    return count * (2 if mode == IDS_U16 else 4)


def _ids_mode(nrows: int, count: int) -> int:
    """The smallest id encoding of ``count`` rows (the lowest mode of equal size)."""
    wide = IDS_U16 if nrows <= 1 << 16 else IDS_U32
    return min((wide, IDS_BITMAP, IDS_EF), key=lambda m: (_ids_size(m, nrows, count), m))


def _bits_le(values: np.ndarray, width: int) -> bytes:
    """``values`` (int64, each < 2^width) in ``width`` bits each, lsb first, in order."""
    if not width or not len(values):
        return b""
    bits = ((values[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(bits.ravel(), bitorder="little").tobytes()


def _unbits_le(view, offset: int, count: int, width: int) -> np.ndarray:
    """The ``count`` values _bits_le wrote at ``offset`` of ``view`` (int64)."""
    if not width or not count:
        return np.zeros(count, dtype=np.int64)
    raw = np.frombuffer(view, dtype=np.uint8, count=-(-count * width // 8), offset=offset)
    bits = np.unpackbits(raw, bitorder="little", count=count * width).reshape(count, width)
    return bits.astype(np.int64) @ (np.int64(1) << np.arange(width, dtype=np.int64))


def _ef_encode(idx: np.ndarray, nrows: int) -> bytes:
    """Elias-Fano code of ascending unique ids below ``nrows``: with L =
    _ef_low_bits(nrows, count), the low L bits of every id (_bits_le), then a bitmap of
    count + ((nrows - 1) >> L) + 1 bits, lsb first, whose bit (id >> L) + i is set for
    the i-th id; each part padded to whole bytes."""
    count = len(idx)
    low = _ef_low_bits(nrows, count)
    v = np.asarray(idx, dtype=np.int64)
    upper = np.zeros(_ef_upper_bits(nrows, count), dtype=np.uint8)
    upper[(v >> low) + np.arange(count)] = 1
    return _bits_le(v & ((1 << low) - 1), low) + np.packbits(upper, bitorder="little"
                                                             ).tobytes()


def _ef_decode(view, nrows: int, count: int) -> np.ndarray | None:
    """The ids of an Elias-Fano code (_ef_encode) at the start of ``view``; None when it
    does not hold ``count`` ids or sets a padding bit."""
    low = _ef_low_bits(nrows, count)
    nlow = -(-count * low // 8)
    nup = _ef_upper_bits(nrows, count)
    upper = np.unpackbits(np.frombuffer(view, dtype=np.uint8, count=-(-nup // 8),
                                        offset=nlow), bitorder="little")
    if upper[nup:].any():
        return None
    pos = np.flatnonzero(upper)
    if len(pos) != count:
        return None
    return ((pos - np.arange(count, dtype=np.int64)) << low) | _unbits_le(view, 0, count, low)


def rate_width(rates: np.ndarray) -> int:
    """Bits a rate code takes in a version-2 row object holding ``rates``."""
    r = np.asarray(rates, dtype=np.int64)
    return int(r.max() - r.min()).bit_length() if len(r) else 0


def _rates_size(mode: int, count: int, width: int = 8) -> int:
    if mode == RATED_NONE:
        return 0
    if mode == RATED_U8:
        return count
    return 2 + -(-count * width // 8)


def rows_nbytes(nrows: int, count: int, row_nbytes: int, *, span: bool = False,
                rated: bool = True, rates: np.ndarray | None = None) -> int:
    """Payload size of a row object as writers write it, without building it (the
    writer's read estimate); ``rates`` the rows' codes where known (else 8 bits each,
    the most)."""
    mode = IDS_SPAN if span else _ids_mode(nrows, count)
    width = 8 if rates is None else rate_width(rates)
    return (_ROWS.size + _ids_size(mode, nrows, count)
            + (_rates_size(RATED_PACKED, count, width) if rated else 0) + count * row_nbytes)


def _max_rows_nbytes(nrows: int, row_nbytes: int) -> int:
    """The largest row object of a whole block any writer writes (either version)."""
    return (_ROWS.size + _ids_size(IDS_BITMAP, nrows, nrows)
            + _rates_size(RATED_PACKED, nrows) + nrows * row_nbytes)


def encode_rows(nrows: int, codes: np.ndarray, *, step: int, cls: int, elem: int = 1,
                index: np.ndarray | None = None, start: int = 0,
                rates: np.ndarray | None = None) -> bytes:
    """Payload of a row object of a block of ``nrows`` rows: ``codes``
    (``uint8[count, row_nbytes]``) are rows ``index`` (ascending, unique, < nrows) or,
    with ``index`` None, the span from ``start``. ``rates``: u8 rate codes of the rows
    (None: all zero, the full put's chunks)."""
    if codes.dtype != np.uint8 or codes.ndim != 2:
        raise ValueError("row codes must be uint8[count, row_nbytes]")
    count, rnb = codes.shape
    check_elem(elem, rnb)
    if index is None:
        mode, ids = IDS_SPAN, b""
        if start < 0 or start + count > nrows:
            raise ValueError("span past the block")
    else:
        if len(index) != count:
            raise ValueError("row ids and codes differ in length")
        start = 0
        mode = _ids_mode(nrows, count)
        idx = np.asarray(index, dtype=np.int64)
        if mode == IDS_BITMAP:
            bits = np.zeros(nrows, dtype=bool)
            bits[idx] = True
            ids = np.packbits(bits, bitorder="little").tobytes()
        elif mode == IDS_EF:
            ids = _ef_encode(idx, nrows)
        else:
            ids = idx.astype("<u2" if mode == IDS_U16 else "<u4").tobytes()
    rated = RATED_NONE if rates is None else RATED_PACKED
    parts = [_ROWS.pack(_ROWS_MAGIC, ROWS_VERSION, mode, elem, rated, nrows, rnb, count,
                        start, step, cls), ids]
    if rates is not None:
        if len(rates) != count:
            raise ValueError("rates and codes differ in length")
        r = np.asarray(rates, dtype=np.uint8).astype(np.int64)
        lo = int(r.min()) if count else 0
        width = rate_width(r)
        parts += [bytes((lo, width)), _bits_le(r - lo, width)]
    parts.append(planes(codes, elem).data)  # type: ignore[arg-type]
    return b"".join(parts)


def read_rows_header(obj: Object, oid: bytes | None = None) -> RowsHeader:
    """Parse and check a row object's header and size."""
    p = obj.payload
    if obj.kind != KIND_BLOCK_ROWS or obj.refs:
        raise ManifestError(f"object kind {obj.kind} is not a row object", oid=oid)
    if len(p) < _ROWS.size:
        raise ManifestError("row object shorter than its header", oid=oid)
    magic, ver, mode, elem, rated, n, rnb, count, start, step, cls = _ROWS.unpack_from(p)
    if magic != _ROWS_MAGIC or ver not in _MAX_IDS or mode > _MAX_IDS[ver] or (
            rated > _MAX_RATED[ver]):
        raise ManifestError(f"row object has bad magic/version {magic!r}/{ver}", oid=oid)
    if elem not in PLANE_WIDTHS or rnb % elem or count > n or (
            mode == IDS_SPAN and start + count > n) or (mode == IDS_U16 and n > 1 << 16):
        raise ManifestError("row object header is invalid", oid=oid)
    rates_at = _ROWS.size + _ids_size(mode, n, count)
    width = 8
    if rated == RATED_PACKED:
        if len(p) < rates_at + 2 or p[rates_at + 1] > 8:
            raise ManifestError("row object's rate codes are invalid", oid=oid)
        width = p[rates_at + 1]
    body_at = rates_at + _rates_size(rated, count, width)
    head = RowsHeader(n, rnb, count, start, mode, bool(rated), step, cls, elem, _ROWS.size,
                      ver, rates_at, body_at, rated)
    want = body_at + count * rnb
    if len(p) != want:
        raise ManifestError(f"row object is {len(p)} bytes, its header says {want}", oid=oid)
    return head


def decode_rows_object(obj: Object, oid: bytes | None = None, *, codes: bool = True
                       ) -> tuple[RowsHeader, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(header, row ids int64 (None for a span: see header.start), rate codes u8,
    codes ``uint8[count, row_nbytes]`` (None unless ``codes``; maybe a read-only view))."""
    head = read_rows_header(obj, oid)
    payload = memoryview(obj.payload)
    view = payload[head.header_size:]
    n, count = head.nrows, head.count
    idx: np.ndarray | None = None
    size = _ids_size(head.ids, n, count)
    if head.ids == IDS_BITMAP:
        bits = np.unpackbits(np.frombuffer(view, dtype=np.uint8, count=size),
                             bitorder="little")[:n]
        idx = np.flatnonzero(bits).astype(np.int64)
        if len(idx) != count:
            raise ManifestError("row object bitmap holds another row count", oid=oid)
    elif head.ids == IDS_EF:
        idx = _ef_decode(view, n, count)
        if idx is None or (count and (idx[-1] >= n or np.any(np.diff(idx) <= 0))):
            raise ManifestError("row object's Elias-Fano ids are invalid", oid=oid)
    elif head.ids != IDS_SPAN:
        dt = "<u2" if head.ids == IDS_U16 else "<u4"
        idx = np.frombuffer(view, dtype=dt, count=count).astype(np.int64)
        if count and (idx[-1] >= n or np.any(np.diff(idx) <= 0)):
            raise ManifestError("row object ids are out of range or not ascending", oid=oid)
    if head.rated_mode == RATED_U8:
        rates = np.frombuffer(payload, dtype=np.uint8, count=count, offset=head.rates_at)
    elif head.rated_mode == RATED_PACKED:
        lo, width = payload[head.rates_at], payload[head.rates_at + 1]
        got = lo + _unbits_le(payload, head.rates_at + 2, count, width)
        if count and got.max() > 255:
            raise ManifestError("row object's rate codes are out of range", oid=oid)
        rates = got.astype(np.uint8)
    else:
        rates = np.full(count, 255, dtype=np.uint8)
    view = payload[head.body_at:]
    rows: np.ndarray | None = None
    if codes:
        if head.elem == 1:
            rows = np.frombuffer(view, dtype=np.uint8, count=count * head.row_nbytes
                                 ).reshape(count, head.row_nbytes)
        else:
            rows = unplanes(view, count, head.row_nbytes, head.elem)
    return head, idx, rates, rows


def encode_list(refs: tuple[bytes, ...], cls: np.ndarray, rows: np.ndarray,
                steps: np.ndarray) -> tuple[bytes, tuple[bytes, ...]]:
    """(payload, refs) of a block's list node: its row objects in the order they apply,
    with each one's class, row count and step."""
    if not len(refs) == len(cls) == len(rows) == len(steps):
        raise ValueError("list entries differ in length")
    doc = {"v": _LIST_VERSION, "cls": np.asarray(cls, dtype=np.uint8).tobytes(),
           "rows": np.asarray(rows, dtype="<u4").tobytes(),
           "step": np.asarray(steps, dtype="<i8").tobytes()}
    return msgpack.packb(doc, use_bin_type=True), tuple(refs)


def encode_list_delta(base: bytes, base_nbytes: int, drop: np.ndarray,
                      refs: tuple[bytes, ...], cls: np.ndarray, rows: np.ndarray,
                      steps: np.ndarray) -> tuple[bytes, tuple[bytes, ...]]:
    """(payload, refs) of a delta list node: full list ``base`` (whose listed objects
    take ``base_nbytes``) but its entries ``drop`` (ascending), then ``refs``."""
    payload, refs = encode_list(refs, cls, rows, steps)
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
    if not delta:
        refs, cls, rows, steps = decode_list(node, oid)
        return ListEntries(refs, cls, rows, steps, oid, refs, None)
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
                       np.concatenate([bsteps[at], steps]), base, brefs, bb)


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
    one = _max_rows_nbytes(nrows, row_nbytes)
    cap = LIST_READ_CAP * nrows * row_nbytes + len(listed) * _ROWS.size
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
                 out: np.ndarray | None = None) -> np.ndarray:
    """Encoded rows of the block whose version is list node ``oid``: its objects applied
    in list order (into ``out`` when given). ManifestError when an object does not fit
    its entry or the block, or a row has no copy."""
    got_list = read_list(get, oid, obj)
    refs, cls, rows, steps = got_list.refs, got_list.cls, got_list.rows, got_list.steps
    if not refs:
        raise ManifestError("block list is empty", oid=oid)
    codes = out
    covered: np.ndarray | None = None
    for k, ref in enumerate(refs):
        part = get(ref)
        head = read_rows_header(part, ref)
        if (head.count, head.cls, head.step) != (rows[k], cls[k], steps[k]):
            raise ManifestError(f"row object {ref.hex()} does not match its list entry",
                                oid=oid)
        if codes is None:
            codes = np.empty((head.nrows, head.row_nbytes), dtype=np.uint8)
        if covered is None:
            covered = np.zeros(len(codes), dtype=bool)
        if (head.nrows, head.row_nbytes) != codes.shape:
            raise ManifestError("row object does not match its block's shape", oid=ref)
        if head.ids == IDS_SPAN and head.elem != 1:
            view = memoryview(part.payload)[head.body_at:]
            unplanes(view, head.count, head.row_nbytes, head.elem,
                      codes[head.start:head.start + head.count])
            covered[head.start:head.start + head.count] = True
            continue
        _, idx, _, got = decode_rows_object(part, ref)
        assert got is not None
        if idx is None:
            codes[head.start:head.start + head.count] = got
            covered[head.start:head.start + head.count] = True
        else:
            codes[idx] = got
            covered[idx] = True
    assert codes is not None and covered is not None
    if not covered.all():
        raise ManifestError(f"block list leaves {int((~covered).sum())} rows with no copy",
                            oid=oid)
    return codes

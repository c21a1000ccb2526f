"""The grouped layout's row objects (docs/design/diff-base.md, "Rows grouped by rate"):
a block's rows, or some of them, with their change rates; block list nodes
(cnrstore/format/rowlists.py) name the row objects a block version applies.

    ROWS = "CNRR" | version u8 | ids u8 | elem u8 | rated u8 | nrows u32 | row_nbytes u32
           | count u32 | start u32 | step i64 | cls u8 | 3 pad
           | row ids (ids 0: none, the span [start, start + count); 1/2: u16/u32 le
             ascending; 3: a bitmap of the block's rows, lsb first; 4, version 2 only:
             Elias-Fano, see _ef_encode) | rates | planes
      rates: rated 0: none (every code 255); 1: u8[count]; 2, version 2 only: lo u8 |
             width u8 | each code - lo in ``width`` bits, lsb first (width 0: all lo);
             3, version 2 only: as 2, each code a count of changes, not a rate
             (cnrstore/core/grouppolicy.py: the lists of a block born with a step)

Writers write version 2: of the id encodings the smallest for the object, the rates
packed, ~1.5 bytes a row where version 1 took 3 (4.4% of an int8 row). Version 1
objects (ids 0-3, rated 0-1) read as they always did.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from cnrstore.errors import ManifestError
from cnrstore.format.planes import PLANE_WIDTHS, check_elem, planes, unplanes
from engine import Object

__all__ = ["KIND_BLOCK_ROWS", "ROWS_HEADER_BYTES", "RATED_COUNTS", "RowsHeader", "rate_code",
           "rate_value",
           "rate_width", "rows_nbytes", "max_rows_nbytes", "encode_rows", "read_rows_header",
           "decode_rows_object"]

KIND_BLOCK_ROWS = 7
ROWS_VERSION = 2          # what writers write; version 1 still reads

_ROWS = struct.Struct("<4sBBBBIIIIqB3x")
_ROWS_MAGIC = b"CNRR"
ROWS_HEADER_BYTES = _ROWS.size
IDS_SPAN, IDS_U16, IDS_U32, IDS_BITMAP, IDS_EF = 0, 1, 2, 3, 4
RATED_NONE, RATED_U8, RATED_PACKED, RATED_COUNTS = 0, 1, 2, 3
# per version: the largest ids and rated values it has
_MAX_IDS = {1: IDS_BITMAP, 2: IDS_EF}
_MAX_RATED = {1: RATED_U8, 2: RATED_COUNTS}


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


def max_rows_nbytes(nrows: int, row_nbytes: int) -> int:
    """The largest row object of a whole block any writer writes (either version)."""
    return (_ROWS.size + _ids_size(IDS_BITMAP, nrows, nrows)
            + _rates_size(RATED_PACKED, nrows) + nrows * row_nbytes)


def encode_rows(nrows: int, codes: np.ndarray, *, step: int, cls: int, elem: int = 1,
                index: np.ndarray | None = None, start: int = 0,
                rates: np.ndarray | None = None, counts: bool = False) -> bytes:
    """Payload of a row object of a block of ``nrows`` rows: ``codes``
    (``uint8[count, row_nbytes]``) are rows ``index`` (ascending, unique, < nrows) or,
    with ``index`` None, the span from ``start``. ``rates``: u8 rate codes of the rows
    (None: all zero, the full put's chunks); ``counts``: they are counts of changes
    (rated 3), not rates."""
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
    rated = RATED_NONE if rates is None else RATED_COUNTS if counts else RATED_PACKED
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
    if rated in (RATED_PACKED, RATED_COUNTS):
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


def decode_rows_object(obj: Object, oid: bytes | None = None, *, codes: bool = True,
                       rates: bool = True
                       ) -> tuple[RowsHeader, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(header, row ids int64 (None for a span: see header.start), rate codes u8 (empty
    unless ``rates``: a restore has no use for them), codes ``uint8[count, row_nbytes]``
    (None unless ``codes``; maybe a read-only view))."""
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
    if not rates:
        rate_codes = np.zeros(0, dtype=np.uint8)
    elif head.rated_mode == RATED_U8:
        rate_codes = np.frombuffer(payload, dtype=np.uint8, count=count, offset=head.rates_at)
    elif head.rated_mode in (RATED_PACKED, RATED_COUNTS):
        lo, width = payload[head.rates_at], payload[head.rates_at + 1]
        got = lo + _unbits_le(payload, head.rates_at + 2, count, width)
        if count and got.max() > 255:
            raise ManifestError("row object's rate codes are out of range", oid=oid)
        rate_codes = got.astype(np.uint8)
    else:
        rate_codes = np.full(count, 255, dtype=np.uint8)
    view = payload[head.body_at:]
    rows: np.ndarray | None = None
    if codes:
        if head.elem == 1:
            rows = np.frombuffer(view, dtype=np.uint8, count=count * head.row_nbytes
                                 ).reshape(count, head.row_nbytes)
        else:
            rows = unplanes(view, count, head.row_nbytes, head.elem)
    return head, idx, rate_codes, rows

"""The grouped layout's row objects (docs/design/diff-base.md, "Rows grouped by rate"):
a block's rows, or some of them, with their change rates; block list nodes
(cnrstore/format/rowlists.py) name the row objects a block version applies.

    ROWS = "CNRR" | version u8 | ids u8 | elem u8 | rated u8 | nrows u32 | row_nbytes u32
           | count u32 | start u32 | step i64 | cls u8 | 3 pad
           | row ids (ids 0: none, the span [start, start + count); 1/2: u16/u32 le
             ascending; 3: a bitmap of the block's rows, lsb first; 4, version 2 and 3:
             Elias-Fano, see rowcodes.ef_encode; 5, version 3 only: Rice-coded gaps,
             see rowcodes.rice_encode) | rates | planes
      rates: rated 0: none (every code 255); 1: u8[count]; 2, version 2 only: lo u8 |
             width u8 | each code - lo in ``width`` bits, lsb first (width 0: all lo);
             3, version 3 only: lo u8 | n u8 | a canonical Huffman code's lengths of
             the n + 1 codes lo..lo + n, 4 bits each, lsb first | each row's codeword,
             msb first, the bits lsb first, to the end of the section, which ends
             where the planes begin (rowcodes.huff_encode)

Writers write version 2, or version 3 where the object takes Rice ids or Huffman rates:
of the id encodings the smallest for the object, the rates packed or Huffman-coded,
whichever is smaller (version 2 took ~1.5 bytes a row for both where version 1 took 3,
4.4% of an int8 row; docs/design/grouped-layout.md has what version 3 saves). Version 1
objects (ids 0-3, rated 0-1) and version 2 objects read as they always did.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from cnrstore.errors import ManifestError
from cnrstore.format.planes import PLANE_WIDTHS, check_elem, planes, unplanes
from cnrstore.format.rowcodes import (
    HUFF_MAX_LEN,
    bits_le,
    ef_decode,
    ef_encode,
    ef_low_bits,
    ef_upper_bits,
    huff_decode,
    huff_encode,
    huff_size,
    rice_decode,
    rice_encode,
    rice_plan,
    rice_size,
    unbits_le,
)
from engine import Object

__all__ = ["KIND_BLOCK_ROWS", "ROWS_HEADER_BYTES", "RowsHeader", "rate_code", "rate_value",
           "rate_width", "rows_nbytes", "max_rows_nbytes", "encode_rows", "read_rows_header",
           "decode_rows_object"]

KIND_BLOCK_ROWS = 7
ROWS_VERSION = 2          # what writers write (3 for Rice ids or Huffman rates); 1 reads

_ROWS = struct.Struct("<4sBBBBIIIIqB3x")
_ROWS_MAGIC = b"CNRR"
ROWS_HEADER_BYTES = _ROWS.size
IDS_SPAN, IDS_U16, IDS_U32, IDS_BITMAP, IDS_EF, IDS_RICE = 0, 1, 2, 3, 4, 5
RATED_NONE, RATED_U8, RATED_PACKED, RATED_HUFF = 0, 1, 2, 3
# per version: the largest ids and rated values it has. Version 3 is version 2 with Rice
# ids and Huffman-coded rates, written only for objects that use either: a reader that
# predates them refuses such an object by its version, and every other object is the
# version 2 object it was, byte for byte.
_MAX_IDS = {1: IDS_BITMAP, 2: IDS_EF, 3: IDS_RICE}
_MAX_RATED = {1: RATED_U8, 2: RATED_PACKED, 3: RATED_HUFF}
_V3 = 3


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


def _ids_size(mode: int, nrows: int, count: int) -> int:
    if mode == IDS_SPAN:
        return 0
    if mode == IDS_BITMAP:
        return -(-nrows // 8)
    if mode == IDS_EF:
        return -(-count * ef_low_bits(nrows, count) // 8) + -(-ef_upper_bits(nrows, count)
                                                               // 8)
    return count * (2 if mode == IDS_U16 else 4)


def _ids_mode(nrows: int, count: int) -> int:
    """The smallest id encoding of ``count`` rows whose size does not depend on the ids
    (the lowest mode of equal size)."""
    wide = IDS_U16 if nrows <= 1 << 16 else IDS_U32
    return min((wide, IDS_BITMAP, IDS_EF), key=lambda m: (_ids_size(m, nrows, count), m))


def _ids_plan(nrows: int, idx: np.ndarray) -> tuple[int, int]:
    """(mode, bytes) of the smallest id encoding of ascending unique ids ``idx``: the
    mode _ids_mode picks, or Rice where smaller."""
    mode = _ids_mode(nrows, len(idx))
    size = _ids_size(mode, nrows, len(idx))
    if len(idx):
        rice = rice_plan(idx)[2]
        if rice < size:
            return IDS_RICE, rice
    return mode, size


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


def _rates_plan(rates: np.ndarray) -> tuple[int, int]:
    """(rated mode, bytes) of the rate section writers write for ``rates``: packed, or
    the Huffman code where smaller."""
    r = np.asarray(rates, dtype=np.int64)
    packed = _rates_size(RATED_PACKED, len(r), rate_width(r))
    huff = huff_size(r - r.min()) if len(r) else None
    return (RATED_HUFF, huff) if huff is not None and huff < packed else (RATED_PACKED,
                                                                        packed)


def rows_nbytes(nrows: int, count: int, row_nbytes: int, *, span: bool = False,
                rated: bool = True, rates: np.ndarray | None = None,
                index: np.ndarray | None = None) -> int:
    """Payload size of a row object as writers write it, without building it (the
    writer's read estimate); ``rates`` the rows' codes and ``index`` their ids where
    known (else 8 bits a rate and the id encodings that do not depend on the ids: at
    most what is written)."""
    if span:
        ids_size = 0
    elif index is not None:
        ids_size = _ids_plan(nrows, np.asarray(index, dtype=np.int64))[1]
    else:
        ids_size = _ids_size(_ids_mode(nrows, count), nrows, count)
    rated_size = 0
    if rated:
        rated_size = (_rates_size(RATED_PACKED, count) if rates is None
                      else _rates_plan(rates)[1])
    return _ROWS.size + ids_size + rated_size + count * row_nbytes


def max_rows_nbytes(nrows: int, row_nbytes: int) -> int:
    """The largest row object of a whole block any writer writes (any version: Rice ids
    and Huffman-coded rates are written only where smaller than these)."""
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
        idx = np.asarray(index, dtype=np.int64)
        mode = _ids_plan(nrows, idx)[0]
        if mode == IDS_RICE:
            ids = rice_encode(idx)
        elif mode == IDS_BITMAP:
            bits = np.zeros(nrows, dtype=bool)
            bits[idx] = True
            ids = np.packbits(bits, bitorder="little").tobytes()
        elif mode == IDS_EF:
            ids = ef_encode(idx, nrows)
        else:
            ids = idx.astype("<u2" if mode == IDS_U16 else "<u4").tobytes()
    rated, section = RATED_NONE, b""
    if rates is not None:
        if len(rates) != count:
            raise ValueError("rates and codes differ in length")
        r = np.asarray(rates, dtype=np.uint8).astype(np.int64)
        lo = int(r.min()) if count else 0
        rated = _rates_plan(r)[0]
        if rated == RATED_HUFF:
            section = bytes((lo,)) + huff_encode(r - lo)
        else:
            width = rate_width(r)
            section = bytes((lo, width)) + bits_le(r - lo, width)
    version = _V3 if rated == RATED_HUFF or mode == IDS_RICE else ROWS_VERSION
    return b"".join([_ROWS.pack(_ROWS_MAGIC, version, mode, elem, rated, nrows, rnb, count,
                                start, step, cls), ids, section,
                     planes(codes, elem).data])


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
    if mode == IDS_RICE:
        ids_size = rice_size(p, _ROWS.size, n, count)
        if ids_size is None:
            raise ManifestError("row object's Rice ids are invalid", oid=oid)
    else:
        ids_size = _ids_size(mode, n, count)
    rates_at = _ROWS.size + ids_size
    width = 8
    if rated == RATED_PACKED:
        if len(p) < rates_at + 2 or p[rates_at + 1] > 8:
            raise ManifestError("row object's rate codes are invalid", oid=oid)
        width = p[rates_at + 1]
    if rated == RATED_HUFF:
        # the codewords run to the planes: the section's size is the payload's rest,
        # within what count codewords of 1 to HUFF_MAX_LEN bits take
        body_at = len(p) - count * rnb
        if len(p) < rates_at + 2 or p[rates_at] + p[rates_at + 1] > 255:
            raise ManifestError("row object's rate codes are invalid", oid=oid)
        stream = body_at - rates_at - 2 - -(-(p[rates_at + 1] + 1) // 2)
        if not -(-count // 8) <= stream <= -(-count * HUFF_MAX_LEN // 8):
            raise ManifestError("row object's rate codes are invalid", oid=oid)
    else:
        body_at = rates_at + _rates_size(rated, count, width)
    head = RowsHeader(n, rnb, count, start, mode, bool(rated), step, cls, elem, _ROWS.size,
                      ver, rates_at, body_at, rated)
    want = body_at + count * rnb
    if len(p) != want:
        raise ManifestError(f"row object is {len(p)} bytes, its header says {want}", oid=oid)
    return head


def decode_rows_object(obj: Object, oid: bytes | None = None, *, codes: bool = True,
                       rates: bool = True, head: RowsHeader | None = None
                       ) -> tuple[RowsHeader, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(header, row ids int64 (None for a span: see header.start), rate codes u8 (empty
    unless ``rates``: a restore has no use for them), codes ``uint8[count, row_nbytes]``
    (None unless ``codes``; maybe a read-only view)). ``head``: what read_rows_header
    gave for ``obj``, where the caller has it (not parsed again)."""
    if head is None:
        head = read_rows_header(obj, oid)
    payload = memoryview(obj.payload)
    view = payload[head.header_size:]
    n, count = head.nrows, head.count
    idx: np.ndarray | None = None
    size = _ids_size(head.ids, n, count)
    if head.ids == IDS_RICE:
        idx = rice_decode(payload, head.header_size, n, count)
        if idx is None:
            raise ManifestError("row object's Rice ids are invalid", oid=oid)
    elif head.ids == IDS_BITMAP:
        bits = np.unpackbits(np.frombuffer(view, dtype=np.uint8, count=size),
                             bitorder="little")[:n]
        idx = np.flatnonzero(bits).astype(np.int64)
        if len(idx) != count:
            raise ManifestError("row object bitmap holds another row count", oid=oid)
    elif head.ids == IDS_EF:
        idx = ef_decode(view, n, count)
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
    elif head.rated_mode == RATED_PACKED:
        lo, width = payload[head.rates_at], payload[head.rates_at + 1]
        got = lo + unbits_le(payload, head.rates_at + 2, count, width)
        if count and got.max() > 255:
            raise ManifestError("row object's rate codes are out of range", oid=oid)
        rate_codes = got.astype(np.uint8)
    elif head.rated_mode == RATED_HUFF:
        values = huff_decode(payload, head.rates_at + 1, head.body_at, count)
        if values is None:
            raise ManifestError("row object's Huffman-coded rate codes are invalid", oid=oid)
        rate_codes = (payload[head.rates_at] + values).astype(np.uint8)
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

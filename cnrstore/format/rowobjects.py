"""The grouped layout's row objects (docs/design/diff-base.md, "Rows grouped by rate"):
a block's rows, or some of them, with their change rates; block list nodes
(cnrstore/format/rowlists.py) name the row objects a block version applies.

    ROWS = "CNRR" | version u8 | ids u8 | elem u8 | rated u8 | nrows u32 | row_nbytes u32
           | count u32 | start u32 | step i64 | cls u8 | 3 pad
           | row ids (ids 0: none, the span [start, start + count); 1/2: u16/u32 le
             ascending; 3: a bitmap of the block's rows, lsb first; 4, version 2 and 3:
             Elias-Fano, see _ef_encode; 5, version 3 only: Rice-coded gaps, see
             _rice_encode) | rates | planes
      rates: rated 0: none (every code 255); 1: u8[count]; 2, version 2 only: lo u8 |
             width u8 | each code - lo in ``width`` bits, lsb first (width 0: all lo);
             3, version 3 only: lo u8 | n u8 | a canonical Huffman code's lengths of
             the n + 1 codes lo..lo + n, 4 bits each, lsb first | each row's codeword,
             msb first, the bits lsb first, to the end of the section, which ends
             where the planes begin (_huff_encode)

Writers write version 2, or version 3 where the object takes Rice ids or Huffman rates:
of the id encodings the smallest for the object, the rates packed or Huffman-coded,
whichever is smaller (version 2 took ~1.5 bytes a row for both where version 1 took 3,
4.4% of an int8 row; docs/design/grouped-layout.md has what version 3 saves). Version 1
objects (ids 0-3, rated 0-1) and version 2 objects read as they always did.
"""

from __future__ import annotations

import functools
import heapq
import struct
from dataclasses import dataclass

import numpy as np

from cnrstore.errors import ManifestError
from cnrstore.format.planes import PLANE_WIDTHS, check_elem, planes, unplanes
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
_RICE_HEAD = struct.Struct("<BI")   # k, bits of the unary part
# Longest Huffman codeword: the lengths are stored in 4 bits.
_HUFF_MAX_LEN = 15


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
    """The smallest id encoding of ``count`` rows whose size does not depend on the ids
    (the lowest mode of equal size)."""
    wide = IDS_U16 if nrows <= 1 << 16 else IDS_U32
    return min((wide, IDS_BITMAP, IDS_EF), key=lambda m: (_ids_size(m, nrows, count), m))


def _rice_plan(idx: np.ndarray) -> tuple[int, int, int]:
    """(k, bits of the unary part, bytes) of the smallest Rice code of ascending unique
    ids ``idx`` (int64, not empty; the smallest k of equal size)."""
    gaps = np.diff(idx, prepend=-1) - 1
    ks = np.arange(min(int(gaps.max()).bit_length(), 31) + 1, dtype=np.int64)
    nup = len(idx) + (gaps[None, :] >> ks[:, None]).sum(axis=1)
    size = _RICE_HEAD.size + -(-len(idx) * ks // 8) + -(-nup // 8)
    k = int(np.argmin(size))
    return k, int(nup[k]), int(size[k])


def _ids_plan(nrows: int, idx: np.ndarray) -> tuple[int, int]:
    """(mode, bytes) of the smallest id encoding of ascending unique ids ``idx``: the
    mode _ids_mode picks, or Rice where smaller."""
    mode = _ids_mode(nrows, len(idx))
    size = _ids_size(mode, nrows, len(idx))
    if len(idx):
        rice = _rice_plan(idx)[2]
        if rice < size:
            return IDS_RICE, rice
    return mode, size


def _rice_encode(idx: np.ndarray) -> bytes:
    """Rice code of ascending unique ids (not empty): the gaps g_0 = id_0, g_i = id_i -
    id_(i-1) - 1, and with k and the unary part's bit count from _rice_plan: k u8 |
    bits u32 | the low k bits of every gap (_bits_le) | for each gap, (gap >> k) zero
    bits then a one, lsb first; each part padded to whole bytes. Elias-Fano's upper
    bits code the ids' high parts, which lose each gap's carry out of the low bits; the
    gaps' do not, ~0.4 bits an id less where a block's objects hold 500 rows and more."""
    k, nup, _ = _rice_plan(idx)
    gaps = np.diff(idx, prepend=-1) - 1
    upper = np.zeros(nup, dtype=np.uint8)
    upper[np.cumsum((gaps >> k) + 1) - 1] = 1
    return (_RICE_HEAD.pack(k, nup) + _bits_le(gaps & ((1 << k) - 1), k)
            + np.packbits(upper, bitorder="little").tobytes())


def _rice_size(view, offset: int, nrows: int, count: int) -> int | None:
    """Bytes of the Rice ids at ``offset`` of ``view`` (whose k and bit count are
    there); None when the header is short or the counts cannot hold ``count`` ids
    below ``nrows``."""
    if not count or len(view) < offset + _RICE_HEAD.size:
        return None
    k, nup = _RICE_HEAD.unpack_from(view, offset)
    if k > 31 or not count <= nup <= count + ((nrows - count) >> k):
        return None
    return _RICE_HEAD.size + -(-count * k // 8) + -(-nup // 8)


def _rice_decode(view, offset: int, nrows: int, count: int) -> np.ndarray | None:
    """The ids of a Rice code (_rice_encode) at ``offset`` of ``view``, whose size
    _rice_size checked; None when its unary part holds another count, ends in a zero or
    sets a pad bit, or an id is past the block."""
    k, nup = _RICE_HEAD.unpack_from(view, offset)
    at = offset + _RICE_HEAD.size
    nlow = -(-count * k // 8)
    upper = np.unpackbits(np.frombuffer(view, dtype=np.uint8, count=-(-nup // 8),
                                        offset=at + nlow), bitorder="little")
    if upper[nup:].any() or not upper[nup - 1]:
        return None
    ends = np.flatnonzero(upper)
    if len(ends) != count:
        return None
    gaps = ((np.diff(ends, prepend=-1) - 1) << k) | _unbits_le(view, at, count, k)
    idx = np.cumsum(gaps + 1) - 1
    return None if idx[-1] >= nrows else idx


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


def _huff_lengths(counts: np.ndarray) -> np.ndarray | None:
    """Codeword lengths (int64, 0 for a symbol that does not occur) of a Huffman code of
    symbols occurring ``counts`` times, at most _HUFF_MAX_LEN bits; None when fewer than
    two symbols occur."""
    syms = np.flatnonzero(counts)
    if len(syms) < 2:
        return None
    lengths = np.zeros(len(counts), dtype=np.int64)
    lengths[syms] = _huff_depths(np.asarray(counts, dtype=np.int64)[syms].tobytes())
    return lengths


@functools.lru_cache(maxsize=1024)
def _huff_depths(weights_le: bytes) -> tuple[int, ...]:
    """Huffman codeword lengths of symbols of int64 weights ``weights_le``, the weights
    halved (each kept at 1 or more) until no codeword passes _HUFF_MAX_LEN bits: the
    rare codes of a large object would. Ties merge the earliest-made node first, so the
    lengths are a function of the weights (ids depend on nothing else). Cached: a
    writer sizes each object for its estimate and again when it writes it."""
    weights = np.frombuffer(weights_le, dtype=np.int64).tolist()
    while True:
        heap = [(w, i, [i]) for i, w in enumerate(weights)]
        heapq.heapify(heap)
        depth = [0] * len(weights)
        made = len(heap)
        while len(heap) > 1:
            na, _, a = heapq.heappop(heap)
            nb, _, b = heapq.heappop(heap)
            for i in a + b:
                depth[i] += 1
            heapq.heappush(heap, (na + nb, made, a + b))
            made += 1
        if max(depth) <= _HUFF_MAX_LEN:
            return tuple(depth)
        weights = [max(w >> 1, 1) for w in weights]


def _huff_codewords(lengths: np.ndarray) -> np.ndarray:
    """The canonical codewords (int64) of codeword ``lengths``: by length, then symbol,
    each the previous one plus 1, shifted left to its length."""
    order = np.lexsort((np.arange(len(lengths)), lengths))
    order = order[lengths[order] > 0]
    words = np.zeros(len(lengths), dtype=np.int64)
    word, prev = 0, int(lengths[order[0]])
    for s in order.tolist():
        word <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        words[s] = word
        word += 1
    return words


def _huff_size(values: np.ndarray) -> int | None:
    """Bytes of the Huffman rate section of codes ``lo + values`` (values int64, min 0);
    None where there is no code (fewer than two distinct values)."""
    counts = np.bincount(values)
    lengths = _huff_lengths(counts)
    if lengths is None:
        return None
    return 2 + -(-len(counts) // 2) + -(-int(counts @ lengths) // 8)


def _huff_encode(values: np.ndarray) -> bytes:
    """The Huffman rate section's table and codewords (after lo) of ``values`` (int64,
    min 0, a code _huff_size sizes): n = the largest value, the n + 1 lengths 4 bits each,
    lsb first, padded to a byte, then each value's canonical codeword msb first, the
    bits lsb first, padded with zero bits to a byte."""
    counts = np.bincount(values)
    lengths = _huff_lengths(counts)
    assert lengths is not None
    words = _huff_codewords(lengths)
    ln, cw = lengths[values], words[values]
    j = np.arange(_HUFF_MAX_LEN, dtype=np.int64)
    bits = (cw[:, None] >> np.maximum(ln[:, None] - 1 - j, 0)) & 1
    stream = np.packbits(bits[j < ln[:, None]].astype(np.uint8), bitorder="little")
    return bytes((len(counts) - 1,)) + _bits_le(lengths, 4) + stream.tobytes()


def _huff_decode(view, offset: int, end: int, count: int) -> np.ndarray | None:
    """The ``count`` values of a Huffman rate section (_huff_encode) in ``view`` from
    ``offset`` (its n byte) to ``end``; None when the table is not a complete prefix
    code, a pad bit is set, or the codewords do not end in the section's last byte."""
    nsym = view[offset] + 1
    at = offset + 1 + -(-nsym // 2)
    if at > end or not count:
        return None
    lengths = _unbits_le(view, offset + 1, nsym + nsym % 2, 4)
    if lengths[nsym:].any():
        return None
    lengths = lengths[:nsym]
    used = lengths > 0
    top = int(lengths.max())
    # complete: every window of top bits starts with exactly one codeword
    if used.sum() < 2 or int((np.int64(1) << (top - lengths[used])).sum()) != 1 << top:
        return None
    words = _huff_codewords(lengths)
    sym_of = np.zeros(1 << top, dtype=np.int64)
    len_of = np.zeros(1 << top, dtype=np.int64)
    for s in np.flatnonzero(used).tolist():
        span = 1 << (top - int(lengths[s]))
        first = int(words[s]) << (top - int(lengths[s]))
        sym_of[first:first + span] = s
        len_of[first:first + span] = lengths[s]
    bits = np.unpackbits(np.frombuffer(view, dtype=np.uint8, count=end - at, offset=at),
                         bitorder="little").astype(np.int64)
    nbits = len(bits)
    padded = np.concatenate([bits, np.zeros(top, dtype=np.int64)])
    window = np.zeros(nbits, dtype=np.int64)
    for k in range(top):
        window = (window << 1) | padded[k:k + nbits]
    # jump[p]: where the codeword starting at bit p ends; nbits + 1 (absorbing) where it
    # would run past the section or starts at its end. The i-th codeword starts at
    # jump applied i times to 0: by doubling, log2(count) gathers, no loop over rows.
    sink = nbits + 1
    jump = np.full(nbits + 2, sink, dtype=np.int64)
    ends = np.arange(nbits, dtype=np.int64) + len_of[window]
    jump[:nbits] = np.where(ends <= nbits, ends, sink)
    starts = np.zeros(count + 1, dtype=np.int64)
    which = np.arange(count + 1, dtype=np.int64)
    for b in range(count.bit_length()):
        sel = (which >> b) & 1 == 1
        starts[sel] = jump[starts[sel]]
        jump = jump[jump]
    last = int(starts[count])
    if last > nbits or last <= nbits - 8 or bits[last:].any():
        return None
    return sym_of[window[starts[:count]]]


def _rates_plan(rates: np.ndarray) -> tuple[int, int]:
    """(rated mode, bytes) of the rate section writers write for ``rates``: packed, or
    the Huffman code where smaller."""
    r = np.asarray(rates, dtype=np.int64)
    packed = _rates_size(RATED_PACKED, len(r), rate_width(r))
    huff = _huff_size(r - r.min()) if len(r) else None
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
            ids = _rice_encode(idx)
        elif mode == IDS_BITMAP:
            bits = np.zeros(nrows, dtype=bool)
            bits[idx] = True
            ids = np.packbits(bits, bitorder="little").tobytes()
        elif mode == IDS_EF:
            ids = _ef_encode(idx, nrows)
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
            section = bytes((lo,)) + _huff_encode(r - lo)
        else:
            width = rate_width(r)
            section = bytes((lo, width)) + _bits_le(r - lo, width)
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
        ids_size = _rice_size(p, _ROWS.size, n, count)
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
        # within what count codewords of 1 to _HUFF_MAX_LEN bits take
        body_at = len(p) - count * rnb
        if len(p) < rates_at + 2 or p[rates_at] + p[rates_at + 1] > 255:
            raise ManifestError("row object's rate codes are invalid", oid=oid)
        stream = body_at - rates_at - 2 - -(-(p[rates_at + 1] + 1) // 2)
        if not -(-count // 8) <= stream <= -(-count * _HUFF_MAX_LEN // 8):
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
    if head.ids == IDS_RICE:
        idx = _rice_decode(payload, head.header_size, n, count)
        if idx is None:
            raise ManifestError("row object's Rice ids are invalid", oid=oid)
    elif head.ids == IDS_BITMAP:
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
    elif head.rated_mode == RATED_PACKED:
        lo, width = payload[head.rates_at], payload[head.rates_at + 1]
        got = lo + _unbits_le(payload, head.rates_at + 2, count, width)
        if count and got.max() > 255:
            raise ManifestError("row object's rate codes are out of range", oid=oid)
        rate_codes = got.astype(np.uint8)
    elif head.rated_mode == RATED_HUFF:
        values = _huff_decode(payload, head.rates_at + 1, head.body_at, count)
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

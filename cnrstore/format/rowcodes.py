"""The bit-level codes of a row object's ids and rate codes (cnrstore/format/rowobjects.py
lays them out in the object; docs/MANIFEST.md, "Row objects and list nodes", is the
spec): values packed lsb first, Elias-Fano and Rice codes of ascending ids, and a
canonical Huffman code of rate codes. Every decoder takes a payload view and offsets its
caller checked against the payload's size, and returns None where the bits are not a
code a writer writes; the caller raises the format's error.
"""

from __future__ import annotations

import functools
import heapq
import struct

import numpy as np

__all__ = ["RICE_HEAD", "HUFF_MAX_LEN", "bits_le", "unbits_le", "ef_low_bits", "ef_upper_bits",
           "ef_encode", "ef_decode", "rice_plan", "rice_encode", "rice_size", "rice_decode",
           "huff_size", "huff_encode", "huff_decode"]

RICE_HEAD = struct.Struct("<BI")   # k, bits of the unary part
# Longest Huffman codeword: the lengths are stored in 4 bits.
HUFF_MAX_LEN = 15


def bits_le(values: np.ndarray, width: int) -> bytes:
    """``values`` (int64, each < 2^width) in ``width`` bits each, lsb first, in order."""
    if not width or not len(values):
        return b""
    bits = ((values[:, None] >> np.arange(width, dtype=np.int64)) & 1).astype(np.uint8)
    return np.packbits(bits.ravel(), bitorder="little").tobytes()


def unbits_le(view, offset: int, count: int, width: int) -> np.ndarray:
    """The ``count`` values bits_le wrote at ``offset`` of ``view`` (int64)."""
    if not width or not count:
        return np.zeros(count, dtype=np.int64)
    raw = np.frombuffer(view, dtype=np.uint8, count=-(-count * width // 8), offset=offset)
    bits = np.unpackbits(raw, bitorder="little", count=count * width).reshape(count, width)
    return bits.astype(np.int64) @ (np.int64(1) << np.arange(width, dtype=np.int64))


def ef_low_bits(nrows: int, count: int) -> int:
    """Low bits per id of an Elias-Fano code of ``count`` ids below ``nrows``."""
    return max(0, (nrows // count).bit_length() - 1) if count else 0


def ef_upper_bits(nrows: int, count: int) -> int:
    return count + (max(nrows - 1, 0) >> ef_low_bits(nrows, count)) + 1


def ef_encode(idx: np.ndarray, nrows: int) -> bytes:
    """Elias-Fano code of ascending unique ids below ``nrows``: with L =
    ef_low_bits(nrows, count), the low L bits of every id (bits_le), then a bitmap of
    count + ((nrows - 1) >> L) + 1 bits, lsb first, whose bit (id >> L) + i is set for
    the i-th id; each part padded to whole bytes."""
    count = len(idx)
    low = ef_low_bits(nrows, count)
    v = np.asarray(idx, dtype=np.int64)
    upper = np.zeros(ef_upper_bits(nrows, count), dtype=np.uint8)
    upper[(v >> low) + np.arange(count)] = 1
    return bits_le(v & ((1 << low) - 1), low) + np.packbits(upper, bitorder="little"
                                                             ).tobytes()


def ef_decode(view, nrows: int, count: int) -> np.ndarray | None:
    """The ids of an Elias-Fano code (ef_encode) at the start of ``view``; None when it
    does not hold ``count`` ids or sets a padding bit."""
    low = ef_low_bits(nrows, count)
    nlow = -(-count * low // 8)
    nup = ef_upper_bits(nrows, count)
    upper = np.unpackbits(np.frombuffer(view, dtype=np.uint8, count=-(-nup // 8),
                                        offset=nlow), bitorder="little")
    if upper[nup:].any():
        return None
    pos = np.flatnonzero(upper)
    if len(pos) != count:
        return None
    return ((pos - np.arange(count, dtype=np.int64)) << low) | unbits_le(view, 0, count, low)


def rice_plan(idx: np.ndarray) -> tuple[int, int, int]:
    """(k, bits of the unary part, bytes) of the smallest Rice code of ascending unique
    ids ``idx`` (int64, not empty; the smallest k of equal size)."""
    gaps = np.diff(idx, prepend=-1) - 1
    ks = np.arange(min(int(gaps.max()).bit_length(), 31) + 1, dtype=np.int64)
    nup = len(idx) + (gaps[None, :] >> ks[:, None]).sum(axis=1)
    size = RICE_HEAD.size + -(-len(idx) * ks // 8) + -(-nup // 8)
    k = int(np.argmin(size))
    return k, int(nup[k]), int(size[k])


def rice_encode(idx: np.ndarray) -> bytes:
    """Rice code of ascending unique ids (not empty): the gaps g_0 = id_0, g_i = id_i -
    id_(i-1) - 1, and with k and the unary part's bit count from rice_plan: k u8 |
    bits u32 | the low k bits of every gap (bits_le) | for each gap, (gap >> k) zero
    bits then a one, lsb first; each part padded to whole bytes. Elias-Fano's upper
    bits code the ids' high parts, which lose each gap's carry out of the low bits; the
    gaps' do not, ~0.4 bits an id less where a block's objects hold 500 rows and more."""
    k, nup, _ = rice_plan(idx)
    gaps = np.diff(idx, prepend=-1) - 1
    upper = np.zeros(nup, dtype=np.uint8)
    upper[np.cumsum((gaps >> k) + 1) - 1] = 1
    return (RICE_HEAD.pack(k, nup) + bits_le(gaps & ((1 << k) - 1), k)
            + np.packbits(upper, bitorder="little").tobytes())


def rice_size(view, offset: int, nrows: int, count: int) -> int | None:
    """Bytes of the Rice ids at ``offset`` of ``view`` (whose k and bit count are
    there); None when the header is short or the counts cannot hold ``count`` ids
    below ``nrows``."""
    if not count or len(view) < offset + RICE_HEAD.size:
        return None
    k, nup = RICE_HEAD.unpack_from(view, offset)
    if k > 31 or not count <= nup <= count + ((nrows - count) >> k):
        return None
    return RICE_HEAD.size + -(-count * k // 8) + -(-nup // 8)


def rice_decode(view, offset: int, nrows: int, count: int) -> np.ndarray | None:
    """The ids of a Rice code (rice_encode) at ``offset`` of ``view``, whose size
    rice_size checked; None when its unary part holds another count, ends in a zero or
    sets a pad bit, or an id is past the block."""
    k, nup = RICE_HEAD.unpack_from(view, offset)
    at = offset + RICE_HEAD.size
    nlow = -(-count * k // 8)
    upper = np.unpackbits(np.frombuffer(view, dtype=np.uint8, count=-(-nup // 8),
                                        offset=at + nlow), bitorder="little")
    if upper[nup:].any() or not upper[nup - 1]:
        return None
    ends = np.flatnonzero(upper)
    if len(ends) != count:
        return None
    gaps = ((np.diff(ends, prepend=-1) - 1) << k) | unbits_le(view, at, count, k)
    idx = np.cumsum(gaps + 1) - 1
    return None if idx[-1] >= nrows else idx


def huff_lengths(counts: np.ndarray) -> np.ndarray | None:
    """Codeword lengths (int64, 0 for a symbol that does not occur) of a Huffman code of
    symbols occurring ``counts`` times, at most HUFF_MAX_LEN bits; None when fewer than
    two symbols occur."""
    syms = np.flatnonzero(counts)
    if len(syms) < 2:
        return None
    lengths = np.zeros(len(counts), dtype=np.int64)
    lengths[syms] = huff_depths(np.asarray(counts, dtype=np.int64)[syms].tobytes())
    return lengths


@functools.lru_cache(maxsize=1024)
def huff_depths(weights_le: bytes) -> tuple[int, ...]:
    """Huffman codeword lengths of symbols of int64 weights ``weights_le``, the weights
    halved (each kept at 1 or more) until no codeword passes HUFF_MAX_LEN bits: the
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
        if max(depth) <= HUFF_MAX_LEN:
            return tuple(depth)
        weights = [max(w >> 1, 1) for w in weights]


def huff_codewords(lengths: np.ndarray) -> np.ndarray:
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


def huff_size(values: np.ndarray) -> int | None:
    """Bytes of the Huffman rate section of codes ``lo + values`` (values int64, min 0);
    None where there is no code (fewer than two distinct values)."""
    counts = np.bincount(values)
    lengths = huff_lengths(counts)
    if lengths is None:
        return None
    return 2 + -(-len(counts) // 2) + -(-int(counts @ lengths) // 8)


def huff_encode(values: np.ndarray) -> bytes:
    """The Huffman rate section's table and codewords (after lo) of ``values`` (int64,
    min 0, a code huff_size sizes): n = the largest value, the n + 1 lengths 4 bits each,
    lsb first, padded to a byte, then each value's canonical codeword msb first, the
    bits lsb first, padded with zero bits to a byte."""
    counts = np.bincount(values)
    lengths = huff_lengths(counts)
    assert lengths is not None
    words = huff_codewords(lengths)
    ln, cw = lengths[values], words[values]
    j = np.arange(HUFF_MAX_LEN, dtype=np.int64)
    bits = (cw[:, None] >> np.maximum(ln[:, None] - 1 - j, 0)) & 1
    stream = np.packbits(bits[j < ln[:, None]].astype(np.uint8), bitorder="little")
    return bytes((len(counts) - 1,)) + bits_le(lengths, 4) + stream.tobytes()


def huff_decode(view, offset: int, end: int, count: int) -> np.ndarray | None:
    """The ``count`` values of a Huffman rate section (huff_encode) in ``view`` from
    ``offset`` (its n byte) to ``end``; None when the table is not a complete prefix
    code, a pad bit is set, or the codewords do not end in the section's last byte."""
    nsym = view[offset] + 1
    at = offset + 1 + -(-nsym // 2)
    if at > end or not count:
        return None
    lengths = unbits_le(view, offset + 1, nsym + nsym % 2, 4)
    if lengths[nsym:].any():
        return None
    lengths = lengths[:nsym]
    used = lengths > 0
    top = int(lengths.max())
    # complete: every window of top bits starts with exactly one codeword
    if used.sum() < 2 or int((np.int64(1) << (top - lengths[used])).sum()) != 1 << top:
        return None
    words = huff_codewords(lengths)
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

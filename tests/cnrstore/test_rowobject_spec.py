"""A row object built by hand from docs/MANIFEST.md ("Row objects and list nodes") reads
as the spec says: the spec is what another reader would be written from."""

from __future__ import annotations

import struct

import numpy as np

from cnrstore.format.rowlists import KIND_BLOCK_ROWS, decode_rows_object
from engine import Object


def _bits(values: list[int], width: int) -> bytes:
    """values in width bits each, lsb first, padded to a byte (the spec's packing)."""
    out = bytearray(-(-len(values) * width // 8))
    for i, v in enumerate(values):
        for b in range(width):
            if v >> b & 1:
                pos = i * width + b
                out[pos // 8] |= 1 << (pos % 8)
    return bytes(out)


def test_a_version_2_object_built_from_the_spec_reads_as_the_spec_says():
    nrows, row_nbytes, step, cls = 1000, 3, 42, 2
    ids = [3, 17, 18, 500, 999]
    codes = [40, 41, 47, 40, 43]
    low = max(0, (nrows // len(ids)).bit_length() - 1)          # floor(log2(200)) = 7
    upper = [0] * (len(ids) + ((nrows - 1) >> low) + 1)
    for i, v in enumerate(ids):
        upper[(v >> low) + i] = 1
    lo = min(codes)
    width = (max(codes) - lo).bit_length()
    rows = np.arange(len(ids) * row_nbytes, dtype=np.uint8).reshape(len(ids), row_nbytes)
    payload = (b"CNRR" + bytes((2, 4, 1, 2))
               + struct.pack("<IIIIqB3x", nrows, row_nbytes, len(ids), 0, step, cls)
               + _bits([v & ((1 << low) - 1) for v in ids], low) + _bits(upper, 1)
               + bytes((lo, width)) + _bits([c - lo for c in codes], width)
               + rows.tobytes())
    head, idx, rates, got = decode_rows_object(Object(KIND_BLOCK_ROWS, (), payload))
    assert head.header_size == 36
    assert (head.version, head.nrows, head.row_nbytes, head.count, head.step, head.cls) == (
        2, nrows, row_nbytes, len(ids), step, cls)
    assert idx is not None and idx.tolist() == ids
    assert rates.tolist() == codes
    assert got is not None and np.array_equal(got, rows)


def test_a_version_3_object_built_from_the_spec_reads_as_the_spec_says():
    # Rice ids and Huffman-coded rates, each built from the spec's words alone
    nrows, row_nbytes, step, cls = 5000, 2, 7, 4
    ids = [0, 9, 10, 700, 701, 4999]
    codes = [90, 90, 93, 90, 91, 90]
    k = 3
    gaps = [ids[0]] + [b - a - 1 for a, b in zip(ids, ids[1:])]     # 0, 8, 0, 689, 0, 4297
    unary: list[int] = []
    for g in gaps:
        unary += [0] * (g >> k) + [1]
    rice = (bytes((k,)) + struct.pack("<I", len(unary)) + _bits([g & 7 for g in gaps], k)
            + _bits(unary, 1))
    # values 0..3 (codes 90..93): 0 four times, 1 and 3 once, 2 never; lengths 1, 2, 0,
    # 2 make a complete code; canonical: 0 -> "0", 1 -> "10", 3 -> "11"
    lo, n = 90, 3
    lengths = [1, 2, 0, 2]
    word = {0: "0", 1: "10", 3: "11"}
    stream = [int(b) for c in codes for b in word[c - lo]]
    rates = bytes((lo, n)) + _bits(lengths, 4) + _bits(stream, 1)
    rows = np.arange(len(ids) * row_nbytes, dtype=np.uint8).reshape(len(ids), row_nbytes)
    payload = (b"CNRR" + bytes((3, 5, 1, 3))
               + struct.pack("<IIIIqB3x", nrows, row_nbytes, len(ids), 0, step, cls)
               + rice + rates + rows.tobytes())
    head, idx, got_rates, got = decode_rows_object(Object(KIND_BLOCK_ROWS, (), payload))
    assert (head.version, head.ids, head.rated_mode) == (3, 5, 3)
    assert (head.nrows, head.row_nbytes, head.count, head.step, head.cls) == (
        nrows, row_nbytes, len(ids), step, cls)
    assert idx is not None and idx.tolist() == ids
    assert got_rates.tolist() == codes
    assert got is not None and np.array_equal(got, rows)

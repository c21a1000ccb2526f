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

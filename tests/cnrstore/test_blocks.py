"""Block payloads: element-plane layout round trips, header checks, and that it pays."""

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.errors import ManifestError
from cnrstore.format.blocks import (
    KIND_BLOCK_FULL,
    KIND_BLOCK_PATCH,
    decode_full,
    decode_patch,
    encode_full,
    encode_patch,
    plane_width,
)
from engine import Object

BASE = b"\x01" * 16


@st.composite
def block_codes(draw):
    elem = draw(st.sampled_from([1, 2, 4, 8]))
    nrows = draw(st.integers(0, 40))
    row_nbytes = elem * draw(st.integers(0, 9))
    data = draw(st.binary(min_size=nrows * row_nbytes, max_size=nrows * row_nbytes))
    codes = np.frombuffer(data, dtype=np.uint8).reshape(nrows, row_nbytes)
    return elem, codes


@settings(max_examples=60, deadline=None)
@given(block_codes())
def test_full_block_round_trips_for_every_element_width(case):
    elem, codes = case
    obj = Object(KIND_BLOCK_FULL, (), encode_full(codes, elem=elem))
    out = decode_full(obj)
    assert out.shape == codes.shape and out.dtype == np.uint8
    assert np.array_equal(out, codes)
    out[...] = 0  # decoded rows are writable (patches apply in place)


@settings(max_examples=60, deadline=None)
@given(block_codes(), st.data())
def test_patch_round_trips_rows_and_indices(case, data):
    elem, codes = case
    nrows = data.draw(st.integers(max(len(codes), 1), 70000))
    index = np.array(
        sorted(data.draw(st.sets(st.integers(0, nrows - 1), min_size=len(codes),
                                 max_size=len(codes)))), dtype=np.int64)
    obj = Object(KIND_BLOCK_PATCH, (BASE,), encode_patch(nrows, index, codes, elem=elem))
    head, idx, out = decode_patch(obj)
    assert head.nrows == nrows and head.elem == elem
    assert np.array_equal(idx, index)
    assert np.array_equal(out, codes)


def test_element_width_must_divide_the_row():
    with pytest.raises(ValueError):
        encode_full(np.zeros((2, 6), np.uint8), elem=4)
    payload = bytearray(encode_full(np.zeros((2, 8), np.uint8), elem=4))
    payload[6] = 3  # the header's element width
    with pytest.raises(ManifestError):
        decode_full(Object(KIND_BLOCK_FULL, (), bytes(payload)))


def test_plane_width_follows_the_scheme():
    assert plane_width("exact", 4, 256) == 1  # rows unsplit, stored raw (docs/design/)
    assert plane_width("exact", 4, 256, exact_planes=True) == 4
    assert plane_width("exact", 8, 64, exact_planes=True) == 8
    assert plane_width("fp16", 4, 128) == 2
    assert plane_width("int8", 4, 68) == 1
    assert plane_width("exact", 1, 7) == 1


def test_element_planes_compress_fp32_rows_better_than_row_order():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4096, 64)).astype(np.float32).view(np.uint8)
    z = zstandard.ZstdCompressor(level=1)
    planes = len(z.compress(encode_full(rows, elem=4)))
    plain = len(z.compress(encode_full(rows, elem=1)))
    assert planes < 0.95 * plain


@settings(max_examples=20, deadline=None)
@given(elem=st.sampled_from([1, 2, 4, 8]), nrows=st.integers(1, 600),
       words=st.integers(1, 12), npatch=st.integers(0, 3), seed=st.integers(0, 99))
def test_resolve_reads_raw_blocks_straight_into_out(tmp_path_factory, elem, nrows, words,
                                                     npatch, seed):
    """Full blocks stored raw (noise), in either layout, read into ``out`` through
    get_into, patches applied on top: the same rows as the decoding path."""
    import engine
    from cnrstore.format.blocks import resolve

    rng = np.random.default_rng(seed)
    rnb = elem * words
    codes = rng.integers(0, 256, (nrows, rnb), dtype=np.uint8)
    with engine.open(str(tmp_path_factory.mktemp("b") / "s"), create=True) as store:
        with store.writer() as w:
            oid = w.put(KIND_BLOCK_FULL, encode_full(codes, elem=elem))
            want = codes.copy()
            for _ in range(npatch):
                idx = np.unique(rng.integers(0, nrows, 1 + nrows // 7))
                rows = rng.integers(0, 256, (len(idx), rnb), dtype=np.uint8)
                want[idx] = rows
                oid = w.put(KIND_BLOCK_PATCH, encode_patch(nrows, idx, rows, elem=elem), (oid,))
        out = np.empty_like(codes)
        got = resolve(store.get, oid, out=out, get_into=store.get_into)
        assert got is out and np.array_equal(out, want)
        assert np.array_equal(resolve(store.get, oid), want)

"""A grouped block's list applied in one call (cnrstore/format/rowapply.py): on the
compiled kernel (cnr_apply_rows) and on the numpy path where there is none, a list of row
objects of every version (1: u16/u32/bitmap ids and u8 rates; 2: Elias-Fano ids and packed
rates; 3: Rice ids and Huffman-coded rates), spans and id sets of every element width,
full and delta lists, restores what the one-object-at-a-time reference (``apply_each``)
and a plain model give, read with one get_many or one get each; and a damaged object is
refused by the kernel wherever the reference refuses it (the kernel may refuse more: the
reference then decides)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from ckpt_util import on_kernel_path
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cnrstore.codec import native
from cnrstore.errors import ManifestError
from cnrstore.format import rowapply
from cnrstore.format.planes import planes
from cnrstore.format.rowcodes import bits_le, ef_encode, huff_encode, huff_size, rice_encode
from cnrstore.format.rowlists import (
    KIND_BLOCK_LIST,
    KIND_BLOCK_ROWS,
    decode_rows_object,
    encode_list,
    encode_list_delta,
    encode_rows,
    read_list,
    read_rows_header,
    resolve_list,
)
from engine import Object

_HEAD = struct.Struct("<4sBBBBIIIIqB3x")


@pytest.fixture(autouse=True, scope="module", params=["native", "fallback"])
def kernel_path(request):
    yield from on_kernel_path(request.param, fallback="fallback")


def _native_on() -> bool:
    return native.kernel() is not None


def row_object(n: int, codes: np.ndarray, *, step: int, cls: int, elem: int, version: int,
               mode: int, rated: int, idx: np.ndarray | None = None, start: int = 0,
               rates: np.ndarray | None = None) -> bytes:
    """A row object laid out by hand in any version's id and rate encodings (writers pick
    the smallest; these are every one a reader must read): ``mode`` 0 a span from
    ``start``, 1/2 u16/u32 ids, 3 a bitmap, 4 Elias-Fano, 5 Rice; ``rated`` 0 none, 1 u8,
    2 packed, 3 Huffman."""
    count = len(codes)
    if mode == 0:
        ids = b""
    elif mode in (1, 2):
        ids = idx.astype("<u2" if mode == 1 else "<u4").tobytes()
    elif mode == 3:
        bits = np.zeros(n, dtype=bool)
        bits[idx] = True
        ids = np.packbits(bits, bitorder="little").tobytes()
    elif mode == 4:
        ids = ef_encode(idx, n)
    else:
        ids = rice_encode(idx)
    r = (rates if rates is not None else np.zeros(count, dtype=np.uint8)).astype(np.int64)
    if rated == 0:
        section = b""
    elif rated == 1:
        section = r.astype(np.uint8).tobytes()
    else:
        lo = int(r.min()) if count else 0
        if rated == 3:
            section = bytes((lo,)) + huff_encode(r - lo)
        else:
            width = int(r.max() - lo).bit_length() if count else 0
            section = bytes((lo, width)) + bits_le(r - lo, width)
    return b"".join([_HEAD.pack(b"CNRR", version, mode, elem, rated, n, codes.shape[1],
                                count, start, step, cls), ids, section,
                     planes(codes, elem).tobytes()])


def _draw_object(data, g: np.random.Generator, n: int, rnb: int, elem: int, step: int
                 ) -> tuple[bytes, np.ndarray]:
    """(payload, the rows it writes) of a random row object of a block of ``n`` rows."""
    count = data.draw(st.integers(1, n))
    codes = g.integers(0, 256, (count, rnb), dtype=np.uint8)
    mode = data.draw(st.sampled_from([0, 1, 2, 3, 4, 5] if n <= 1 << 16 else [0, 2, 3, 4, 5]))
    rates = g.integers(0, data.draw(st.sampled_from([1, 4, 256])), count).astype(np.uint8)
    if mode == 0:
        start = data.draw(st.integers(0, n - count))
        at, idx = np.arange(start, start + count), None
    else:
        start, idx = 0, np.sort(g.choice(n, size=count, replace=False))
        at = idx
    low = 3 if mode == 5 else 2 if mode == 4 else 1
    version = data.draw(st.integers(low, 3))
    rated = data.draw(st.integers(0, {1: 1, 2: 2, 3: 3}[version]))
    if rated == 3 and huff_size(rates.astype(np.int64) - int(rates.min())) is None:
        rated = 2  # one distinct code: no Huffman code of it
    p = row_object(n, codes, step=step, cls=data.draw(st.integers(0, 255)), elem=elem,
                   version=version, mode=mode, rated=rated, idx=idx, start=start, rates=rates)
    return p, at


def _draw_list(data):
    """(objects by id, the list's id, the block's rows as a model applies them)."""
    n = data.draw(st.sampled_from([1, 2, 7, 64, 80, 300, 70000]))
    rnb, elem = data.draw(st.sampled_from([(4, 1), (4, 4), (6, 2), (3, 1), (8, 8), (0, 1)]))
    g = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    objs: dict[bytes, Object] = {}
    refs, cls, rows, steps = [], [], [], []
    model = np.zeros((n, rnb), dtype=np.uint8)

    def add(payload: bytes, step: int) -> None:
        oid = struct.pack("<QQ", len(objs), 7)
        objs[oid] = Object(KIND_BLOCK_ROWS, (), payload)
        head = read_rows_header(objs[oid])
        refs.append(oid), cls.append(head.cls), rows.append(head.count), steps.append(step)

    first = g.integers(0, 256, (n, rnb), dtype=np.uint8)
    chunks = data.draw(st.integers(1, 3))
    bounds = np.linspace(0, n, chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            add(encode_rows(n, first[a:b], step=0, cls=0, elem=elem, start=int(a)), 0)
    model[:] = first
    for step in range(1, data.draw(st.integers(0, 8)) + 1):
        if n > 1000:  # keep a large block's objects small
            count = data.draw(st.integers(1, 400))
            codes = g.integers(0, 256, (count, rnb), dtype=np.uint8)
            idx = np.sort(g.choice(n, size=count, replace=False))
            p = encode_rows(n, codes, step=step, cls=1, elem=elem, index=idx,
                            rates=g.integers(0, 9, count).astype(np.uint8))
            at = idx
            model[idx] = codes
        else:
            p, at = _draw_object(data, g, n, rnb, elem, step)
            _, _, _, got = decode_rows_object(Object(KIND_BLOCK_ROWS, (), p), rates=False)
            model[at] = got
        add(p, step)
    payload, lrefs = encode_list(tuple(refs), np.array(cls), np.array(rows), np.array(steps))
    top = b"L" * 16
    objs[top] = Object(KIND_BLOCK_LIST, lrefs, payload)
    if len(refs) > 1 and data.draw(st.booleans()):  # a delta: drop one entry, add one
        drop = data.draw(st.integers(0, len(refs) - 1))
        idx = np.arange(n)
        codes = g.integers(0, 256, (n, rnb), dtype=np.uint8)
        extra = encode_rows(n, codes, step=99, cls=3, elem=elem, index=idx)
        objs[b"X" * 16] = Object(KIND_BLOCK_ROWS, (), extra)
        payload, drefs = encode_list_delta(top, 0, np.array([drop]), (b"X" * 16,),
                                           np.array([3]), np.array([n]), np.array([99]))
        top = b"D" * 16
        objs[top] = Object(KIND_BLOCK_LIST, drefs, payload)
        model = codes
    return objs, top, model


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_list_applies_as_the_reference_and_the_model_say(data):
    objs, top, model = _draw_list(data)
    entries = read_list(objs.__getitem__, top)
    parts = [objs[r] for r in entries.refs]
    want = rowapply.apply_each(entries, parts, top)
    assert np.array_equal(want, model)
    fast = rowapply.apply_native(entries, parts)
    assert (fast is not None) == _native_on()
    if fast is not None:
        assert np.array_equal(fast, model)
    asked = []

    def get_many(oids):
        asked.append(tuple(oids))
        return [objs[o] for o in oids]

    assert np.array_equal(resolve_list(objs.__getitem__, top), model)
    out = np.full_like(model, 7)
    assert resolve_list(objs.__getitem__, top, out=out, get_many=get_many) is out
    assert np.array_equal(out, model) and len(asked) == 1
    # payloads that are not bytes (a memoryview of a read buffer, a bytearray)
    views = [Object(p.kind, p.refs, memoryview(bytearray(p.payload))) for p in parts]
    assert np.array_equal(rowapply.apply_list(entries, views, top), model)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_damaged_object_is_refused_wherever_the_reference_refuses_it(data):
    if not _native_on():
        return  # the fallback is the reference
    objs, top, model = _draw_list(data)
    entries = read_list(objs.__getitem__, top)
    parts = [objs[r] for r in entries.refs]
    # into the block's own buffer, as a restore reads (a header's row count is then
    # checked against it, not allocated)
    out = np.zeros_like(model)
    k = data.draw(st.integers(0, len(parts) - 1))
    p = bytearray(parts[k].payload)
    head = read_rows_header(parts[k])
    hi = min(len(p), head.body_at + 2)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, hi - 1))
        if data.draw(st.booleans()):
            p[at] = data.draw(st.integers(0, 255))
        else:
            p[at] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(-2, 2))
    if cut:
        at = data.draw(st.integers(36, len(p)))
        if cut < 0:
            del p[at:at - cut]
        else:
            p[at:at] = bytes(cut)
    parts[k] = Object(KIND_BLOCK_ROWS, (), bytes(p))
    try:
        want = rowapply.apply_each(entries, parts, top, out=out.copy())
    except ManifestError:
        want = None
    fast = rowapply.apply_native(entries, parts, out=out.copy())
    if want is None:
        assert fast is None
        with pytest.raises(ManifestError):
            rowapply.apply_list(entries, parts, top, out=out.copy())
    else:
        assert fast is None or np.array_equal(fast, want)
        assert np.array_equal(rowapply.apply_list(entries, parts, top, out=out.copy()), want)


def _block(n: int = 16, rnb: int = 4):
    codes = np.arange(n * rnb, dtype=np.uint8).reshape(n, rnb)
    return codes, Object(KIND_BLOCK_ROWS, (), encode_rows(n, codes[: n // 2], step=0, cls=0))


def test_a_row_with_no_copy_or_an_entry_that_does_not_match_is_the_references_error():
    codes, chunk = _block()
    objs = {b"c" * 16: chunk}
    payload, refs = encode_list((b"c" * 16,), np.array([0]), np.array([8]), np.array([0]))
    objs[b"l" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    entries = read_list(objs.__getitem__, b"l" * 16)
    assert rowapply.apply_native(entries, [chunk]) is None
    with pytest.raises(ManifestError, match="8 rows with no copy"):
        rowapply.apply_list(entries, [chunk], b"l" * 16)
    for cls, rows, step in ((1, 8, 0), (0, 7, 0), (0, 8, 1)):
        payload, refs = encode_list((b"c" * 16,), np.array([cls]), np.array([rows]),
                                    np.array([step]))
        node = Object(KIND_BLOCK_LIST, refs, payload)
        bad = read_list({b"x" * 16: node}.__getitem__, b"x" * 16)
        assert rowapply.apply_native(bad, [chunk]) is None
        with pytest.raises(ManifestError, match="list entry"):
            rowapply.apply_list(bad, [chunk], b"x" * 16)
    # a list node or an object with refs where a row object belongs
    wrong = Object(KIND_BLOCK_ROWS, (b"c" * 16,), chunk.payload)
    assert rowapply.apply_native(entries, [wrong]) is None
    with pytest.raises(ManifestError, match="not a row object"):
        rowapply.apply_list(entries, [wrong], b"l" * 16)


def test_the_last_copy_of_a_row_wins_whatever_the_objects_encodings():
    n, rnb = 300, 4
    g = np.random.default_rng(3)
    want = g.integers(0, 256, (n, rnb), dtype=np.uint8)
    objs, refs, cls, rows, steps = {}, [], [], [], []
    # every row written three times (u16, u32, bitmap, Elias-Fano, Rice ids); the third
    # copy, the last listed, is what a read returns
    for copy in range(3):
        for mode in (1, 2, 3, 4, 5):
            at = np.arange(mode - 1, n, 5)
            codes = want[at] if copy == 2 else g.integers(0, 256, (len(at), rnb),
                                                          dtype=np.uint8)
            version = 3 if mode == 5 else 2 if mode == 4 else 1
            p = row_object(n, codes, step=copy, cls=mode, elem=1, version=version,
                           mode=mode, rated=1 if version == 1 else 2, idx=at,
                           rates=g.integers(0, 255, len(at)).astype(np.uint8))
            oid = bytes([copy, mode]) * 8
            objs[oid] = Object(KIND_BLOCK_ROWS, (), p)
            refs.append(oid), cls.append(mode), rows.append(len(at)), steps.append(copy)
    payload, lrefs = encode_list(tuple(refs), np.array(cls), np.array(rows), np.array(steps))
    objs[b"L" * 16] = Object(KIND_BLOCK_LIST, lrefs, payload)
    assert np.array_equal(resolve_list(objs.__getitem__, b"L" * 16), want)
    entries = read_list(objs.__getitem__, b"L" * 16)
    fast = rowapply.apply_native(entries, [objs[r] for r in entries.refs])
    assert (fast is not None) == _native_on()
    assert fast is None or np.array_equal(fast, want)

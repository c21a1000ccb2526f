"""The grouped layout (Options.layout="grouped", docs/design/diff-base.md "Rows grouped by
rate"): block versions as lists of row objects. Every kept step restores what a plain
in-memory model of the tables says (exactly under "exact", within the quantizer's bound
under int8), whatever the changed rows and however the handle is closed, restored and
reopened between puts; the ids do not depend on that; verify, gc and a damaged listed
object behave as they do for chains."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
from ckpt_util import assert_identical
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_damaged_base import _rot

import cnrstore
from cnrstore.core import grouppolicy
from cnrstore.core.options import OptionsMismatch
from cnrstore.errors import ManifestError
from cnrstore.format.blocks import resolve
from cnrstore.format.load import load_manifest
from cnrstore.format.rowlists import (
    KIND_BLOCK_LIST,
    KIND_BLOCK_ROWS,
    decode_rows_object,
    encode_list,
    encode_list_delta,
    encode_rows,
    plan_list,
    rate_code,
    rate_value,
    read_list,
    rows_nbytes,
)
from cnrstore.format.rowobjects import IDS_EF, IDS_RICE, RATED_HUFF, RATED_PACKED, rate_width
from engine import Object

OPTS = {"block_rows": 64, "fanout": 4, "layout": "grouped"}
# int8 codes of rows of values within +-3: a row's error is at most half a step of its
# own range over 255 levels (docs/QUANTIZATION.md); 6/255/2 with room for the fp16 scale.
INT8_BOUND = 0.02


def _tables(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": (torch.rand(300, 4, generator=g) * 6 - 3),
            "b": (torch.rand(70, 2, generator=g) * 6 - 3)}


def _check(got: dict, want: dict, scheme: str) -> None:
    for name, x in want.items():
        if scheme == "exact":
            assert_identical(got[name], x)
        else:
            assert (got[name] - x).abs().max().item() <= INT8_BOUND


def _forms(path, steps) -> set[str]:
    """"full" and/or "delta": the forms of the list nodes the kept ``steps`` name."""
    got = set()
    with cnrstore.open(path) as s:
        for step in steps:
            for tm in load_manifest(s.objects, step).tables.values():
                for oid in tm.block_ids:
                    got.add("full" if read_list(s.objects.get, oid).base == oid else "delta")
    return got


def _run(path, scheme: str, plan: list[tuple[int, list[int], str]]) -> list[dict]:
    """Put step 0, then for each (table index, rows changed, what the handle does
    before the put: "keep", "reopen", "restore", or "async": a non-blocking put told the
    touched rows) a step; return each step's table ids
    after checking every kept step against the model."""
    model = _tables(0)
    kept: dict[int, dict[str, torch.Tensor]] = {}
    ids = []
    s = cnrstore.open(path, **OPTS)
    try:
        s.put_tables(0, model, quant=scheme)
        kept[0] = {k: v.clone() for k, v in model.items()}
        ids.append(s.steps()[-1])
        for step, (which, rows, before) in enumerate(plan, start=1):
            name = "ab"[which]
            x = model[name]
            idx = torch.tensor(sorted({r % x.shape[0] for r in rows}), dtype=torch.long)
            if len(idx):
                g = torch.Generator().manual_seed(step)
                x[idx] = torch.rand(len(idx), x.shape[1], generator=g) * 6 - 3
            if before == "reopen":
                s.close()
                s = cnrstore.open(path)
            elif before == "restore":
                s.close()
                s = cnrstore.open(path)
                _check(s.get_tables(step - 1), kept[step - 1], scheme)
            if before == "async":  # non-blocking, told the touched rows: the deferred encode
                touched = {name: idx, "ab"[1 - which]: torch.zeros(0, dtype=torch.long)}
                info = s.put_tables(step, model, quant=scheme, blocking=False,
                                    touched=touched).result()
            else:
                info = s.put_tables(step, model, quant=scheme)
            assert info.rewritten_blocks == 0
            kept[step] = {k: v.clone() for k, v in model.items()}
            ids.append(info.tables)
        for step, want in kept.items():
            _check(s.get_tables(step), want, scheme)
        assert s.verify(deep=True).ok
    finally:
        s.close()
    return ids


_step = st.tuples(st.integers(0, 1), st.lists(st.integers(0, 400), max_size=60),
                  st.sampled_from(["keep", "async", "reopen", "restore"]))


@pytest.mark.parametrize("scheme", ["exact", "int8"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(_step, min_size=1, max_size=14),
       share=st.sampled_from([grouppolicy.DELTA_SHARE, 0.0, 8.0]))
def test_every_kept_step_restores_the_model(tmp_path_factory, scheme, plan, share):
    # share: when a list is written whole again (as built; every list a delta of zero
    # entries or whole; deltas up to what a read plans for, rowlists.plan_list)
    saved, grouppolicy.DELTA_SHARE = grouppolicy.DELTA_SHARE, share
    try:
        _run(tmp_path_factory.mktemp("g"), scheme, plan)
    finally:
        grouppolicy.DELTA_SHARE = saved


@pytest.mark.parametrize("scheme", ["exact", "int8"])
def test_ids_do_not_depend_on_reopening(tmp_path, scheme):
    rng = np.random.default_rng(5)
    # Zipf-drawn rows, 40 steps: classes move and the cleaner runs (asserted below).
    plan = [(int(rng.integers(2)), (rng.zipf(1.4, size=40) * 7).tolist(), "keep")
            for _ in range(40)]
    a = _run(tmp_path / "a", scheme, plan)
    b = _run(tmp_path / "b", scheme, [(w, r, "reopen" if i % 3 else "restore")
                                      for i, (w, r, _) in enumerate(plan)])
    assert a[1:] == b[1:]
    # deltas, and lists written whole again once their delta passed DELTA_SHARE
    assert _forms(tmp_path / "a", range(1, 41)) == {"full", "delta"}
    with cnrstore.open(tmp_path / "a") as s:
        tm = load_manifest(s.objects, 40).tables["a"]
        classes = set()
        for oid in tm.block_ids:
            entries = read_list(s.objects.get, oid)
            classes |= set(entries.cls.tolist())
            assert len(entries.refs) < 40  # cleaned: the full put's chunks, stale objects left
        assert classes - {0}, "no row ever left class 0"


def test_layout_is_stored_and_a_reopen_uses_it(tmp_path):
    path = tmp_path / "s"
    with cnrstore.open(path, layout="grouped", block_rows=64) as s:
        s.put_tables(0, _tables(1))
    with cnrstore.open(path) as s:
        assert s.options.layout == "grouped"
        t = _tables(1)
        t["a"][3] += 1
        s.put_tables(1, t)
        tm = load_manifest(s.objects, 1).tables["a"]
        assert s.objects.info(tm.block_ids[0]).kind == KIND_BLOCK_LIST
    with pytest.raises(OptionsMismatch):
        cnrstore.open(path, layout="chains")
    with cnrstore.open(tmp_path / "c", block_rows=64) as s:
        s.put_tables(0, _tables(1))
    with pytest.raises(OptionsMismatch):
        cnrstore.open(tmp_path / "c", layout="grouped")
    with pytest.raises(cnrstore.InvalidInput):
        cnrstore.open(tmp_path / "d", layout="rows")


def test_gc_keeps_what_the_kept_lists_name(tmp_path):
    path = tmp_path / "s"
    model = _tables(2)
    with cnrstore.open(path, **OPTS) as s:
        for step in range(30):
            model["a"][torch.randint(0, 300, (20,))] += 0.5
            s.put_tables(step, model)
        want = {k: v.clone() for k, v in model.items()}
        s.gc(keep_last=1)
        assert s.steps() == [29]
        _check(s.get_tables(29), want, "exact")
        assert s.verify(deep=True).ok
        model["a"][5] += 1
        s.put_tables(30, model)
        _check(s.get_tables(30), model, "exact")


@pytest.mark.parametrize("scheme", ["exact", "int8"])
def test_a_damaged_listed_object_makes_the_next_put_write_the_block_fresh(tmp_path, scheme):
    path = tmp_path / "s"
    model = _tables(3)
    with cnrstore.open(path, compression_level=0, **OPTS) as s:
        s.put_tables(0, model, quant=scheme)
        model["a"][[1, 2, 70]] += 1
        s.put_tables(1, model, quant=scheme)
        tm = load_manifest(s.objects, 1).tables["a"]
        refs = s.objects.get(tm.block_ids[0]).refs
        _rot(path, s.objects.get(refs[0]).payload)  # a chunk of the full put
    with cnrstore.open(path) as s:
        assert not s.verify(deep=True).ok
        model["a"][200] += 1  # block 0 unchanged: its listed chunk is the damaged one
        info = s.put_tables(2, model, quant=scheme)
        assert info.rewritten_blocks == 1
        _check(s.get_tables(2), model, scheme)
        model["a"][3] += 1  # and block 0 is an ordinary list again
        info = s.put_tables(3, model, quant=scheme)
        assert info.rewritten_blocks == 0
        _check(s.get_tables(3), model, scheme)


def test_cleaning_holds_the_listed_bytes_at_the_read_target(tmp_path):
    rng = np.random.default_rng(7)
    x = torch.zeros(4096, 16)
    with cnrstore.open(tmp_path / "s", block_rows=2048, layout="grouped") as s:
        s.put_tables(0, {"t": x})
        for step in range(1, 60):
            rows = np.unique(rng.zipf(1.2, size=400) % 4096)
            x[torch.from_numpy(rows)] += 1
            s.put_tables(step, {"t": x})
            tm = load_manifest(s.objects, step).tables["t"]
            for oid in tm.block_ids:
                refs = read_list(s.objects.get, oid).refs
                listed = sum(s.objects.info(r).raw_len for r in refs)
                assert listed <= (grouppolicy.READ_TARGET + 0.02) * 2048 * 64
        assert_identical(s.get_tables(59)["t"], x)


def test_row_objects_round_trip():
    g = np.random.default_rng(1)
    for n, count, elem in ((64, 5, 1), (64, 60, 4), (70000, 3, 2), (1000, 900, 1)):
        idx = np.sort(g.choice(n, size=count, replace=False))
        codes = g.integers(0, 256, size=(count, 8), dtype=np.uint8)
        rates = rate_code(g.random(count))
        p = encode_rows(n, codes, step=7, cls=2, elem=elem, index=idx, rates=rates)
        head, got_idx, got_rates, got = decode_rows_object(Object(KIND_BLOCK_ROWS, (), p))
        assert (head.nrows, head.count, head.step, head.cls) == (n, count, 7, 2)
        assert np.array_equal(got_idx, idx) and np.array_equal(got_rates, rates)
        assert np.array_equal(got, codes)
    r = np.array([0.0, 1e-6, 0.02, 0.3, 1.0])
    assert np.allclose(rate_value(rate_code(r)), r, rtol=0.05, atol=3e-5)


# Frozen payloads of a row object (4 rows of 3 bytes of a 64-row block, step 9, class 2):
# version 1 (u16 ids, u8 rates), which stores written before 2026-12 hold, and version 2
# (Elias-Fano ids, packed rates), what writers write now. Both must read as they are.
_CODES = np.arange(12, dtype=np.uint8).reshape(4, 3)
_GOLDEN_V1 = bytes.fromhex(
    "434e525201010101400000000300000004000000000000000900000000000000020000000100050006"
    "003c000010ff28000102030405060708090a0b")
_GOLDEN_V2 = bytes.fromhex(
    "434e5252020401024000000003000000040000000000000009000000000000000200000051c6471005"
    "041c0c000102030405060708090a0b")


def _round_trip(nrows: int, codes: np.ndarray, idx: np.ndarray, rates: np.ndarray, *,
                step: int, cls: int):
    """(header, payload) of a row object of ``codes`` at rows ``idx`` with ``rates``,
    checked to be the size rows_nbytes gives, to read back as written, and to be
    version 3 exactly where it takes Rice ids or Huffman-coded rates."""
    p = encode_rows(nrows, codes, step=step, cls=cls, index=idx, rates=rates)
    assert len(p) == rows_nbytes(nrows, len(idx), codes.shape[1], rates=rates, index=idx)
    head, got_idx, got_rates, got = decode_rows_object(Object(KIND_BLOCK_ROWS, (), p))
    assert np.array_equal(got_idx, idx) and np.array_equal(got_rates, rates)
    assert np.array_equal(got, codes)
    assert head.version == (3 if head.ids == IDS_RICE or head.rated_mode == RATED_HUFF else 2)
    return head, p


@pytest.mark.parametrize("payload, rates, version", [
    (_GOLDEN_V1, [0, 16, 255, 40], 1), (_GOLDEN_V2, [20, 16, 23, 40], 2)])
def test_golden_row_objects_still_read(payload, rates, version):
    head, idx, got_rates, got = decode_rows_object(Object(KIND_BLOCK_ROWS, (), payload))
    assert (head.version, head.nrows, head.count, head.step, head.cls) == (version, 64, 4, 9, 2)
    assert idx.tolist() == [1, 5, 6, 60] and got_rates.tolist() == rates
    assert np.array_equal(got, _CODES)
    if version == 2:  # writers write this version, byte for byte
        assert encode_rows(64, _CODES, step=9, cls=2, index=np.array([1, 5, 6, 60]),
                           rates=np.array(rates, dtype=np.uint8)) == payload


def _chunk_and_object(second: bytes, born: int | None = None) -> tuple[dict, np.ndarray]:
    """(objects, the chunk's rows) of a 64-row block: one chunk written at step 0, then
    row object ``second`` (rows 1, 5, 6, 60 at step 9, class 2) listed after it under
    list b"l" * 16, with ``born`` (None: a list as written before counts)."""
    base = np.arange(64 * 3, dtype=np.uint8).reshape(64, 3)
    objs = {b"c" * 16: Object(KIND_BLOCK_ROWS, (), encode_rows(64, base, step=0, cls=0)),
            b"g" * 16: Object(KIND_BLOCK_ROWS, (), second)}
    payload, refs = encode_list((b"c" * 16, b"g" * 16), np.array([0, 2]), np.array([64, 4]),
                                np.array([0, 9]), born=born)
    objs[b"l" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    return objs, base


def test_a_version_1_object_listed_with_version_2_ones_restores_and_seeds_the_writer():
    # a store written before version 2, put to again: its lists hold both versions
    objs, base = _chunk_and_object(_GOLDEN_V1)
    want = base.copy()
    want[[1, 5, 6, 60]] = _CODES
    assert np.array_equal(resolve(objs.__getitem__, b"l" * 16), want)
    group = grouppolicy.load_group(objs.__getitem__, b"l" * 16, 64, 3)
    assert group is not None and group.owner[[1, 5, 6, 60]].tolist() == [1] * 4
    assert group.rq[[1, 5, 6, 60]].tolist() == [0, 16, 255, 40]
    assert group.pieces[1].nbytes == len(_GOLDEN_V1)


def test_version_2_row_objects_take_less_than_version_1():
    # ids and rates of an int8 block's objects: ~1.5 bytes a row where v1 took 3
    g = np.random.default_rng(3)
    for count in (300, 3000):
        idx = np.sort(g.choice(32768, size=count, replace=False))
        rates = rate_code(0.02 + 0.02 * g.random(count))
        p = encode_rows(32768, np.zeros((count, 68), dtype=np.uint8), step=1, cls=0,
                        index=idx, rates=rates)
        assert len(p) - 36 - 68 * count < 1.75 * count


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 70000), st.data())
def test_row_ids_and_rates_round_trip(nrows, data):
    count = data.draw(st.integers(1, min(nrows, 300)))
    if data.draw(st.booleans()):  # dense: up to every row
        count = data.draw(st.integers(1, min(nrows, 5000)))
    seed = data.draw(st.integers(0, 2 ** 32 - 1))
    g = np.random.default_rng(seed)
    idx = np.sort(g.choice(nrows, size=count, replace=False))
    lo, hi = sorted(data.draw(st.tuples(st.integers(0, 255), st.integers(0, 255))))
    rates = g.integers(lo, hi + 1, size=count).astype(np.uint8)
    codes = g.integers(0, 256, size=(count, 2), dtype=np.uint8)
    _round_trip(nrows, codes, idx, rates, step=3, cls=1)


def test_crafted_version_2_ids_and_rates_are_refused():
    idx = np.array([1, 5, 6, 60])
    p = bytearray(encode_rows(64, _CODES, step=9, cls=2, index=idx,
                              rates=np.array([20, 16, 23, 40], dtype=np.uint8)))
    v1 = bytearray(p)
    v1[4] = 1  # Elias-Fano ids in a version 1 object
    with pytest.raises(ManifestError, match="version"):
        decode_rows_object(Object(KIND_BLOCK_ROWS, (), bytes(v1)))
    extra = bytearray(p)
    extra[36 + 2] |= 0x80  # a fifth id in the upper bits (after 2 bytes of low bits)
    with pytest.raises(ManifestError, match="Elias-Fano"):
        decode_rows_object(Object(KIND_BLOCK_ROWS, (), bytes(extra)))
    wide = bytearray(p)
    wide[36 + 3 + 1] = 9  # rate codes of 9 bits
    with pytest.raises(ManifestError, match="rate codes"):
        decode_rows_object(Object(KIND_BLOCK_ROWS, (), bytes(wide)))
    past = bytearray(p)
    past[36 + 3] = 250  # lo + a code's offset past 255
    with pytest.raises(ManifestError, match="rate codes"):
        decode_rows_object(Object(KIND_BLOCK_ROWS, (), bytes(past)))


# A frozen version-3 payload: 48 rows of a 12240-row block (step 9, class 2), Rice ids
# (gaps of 254: 9 bits an id where Elias-Fano takes 10, less Rice's 5 bytes of header) and
# Huffman-coded rates (40 of the 48 at one code). Writers write it byte for byte; it
# reads as it is.
_V3_IDS = np.arange(48) * 255 + 3
_V3_RATES = [100, 100, 102, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100, 101, 100, 100,
             101, 100, 102, 100, 100, 100, 100, 107, 100, 100, 100, 100, 100, 101, 107, 100,
             100, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100, 101, 100]
_V3_CODES = np.arange(48, dtype=np.uint8).reshape(48, 1)
_GOLDEN_V3 = bytes.fromhex(
    "434e525203050103d02f0000010000003000000000000000090000000000000002000000075f0000"
    "0003bfdfeff7fbfd7ebfdfeff7fbfd7ebfdfeff7fbfd7ebfdfeff7fbfd7ebfdfeff7fbfd7ebfdfef"
    "f7fbfd5555555555555555555555556407210300300c80c8e0a0030002000102030405060708090a"
    "0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f")


def test_golden_version_3_object_reads_and_is_what_writers_write():
    head, idx, rates, got = decode_rows_object(Object(KIND_BLOCK_ROWS, (), _GOLDEN_V3))
    assert (head.version, head.ids, head.rated_mode) == (3, IDS_RICE, RATED_HUFF)
    assert (head.nrows, head.count, head.step, head.cls) == (12240, 48, 9, 2)
    assert idx.tolist() == _V3_IDS.tolist() and rates.tolist() == _V3_RATES
    assert np.array_equal(got, _V3_CODES)
    r = np.array(_V3_RATES, dtype=np.uint8)
    assert encode_rows(12240, _V3_CODES, step=9, cls=2, index=_V3_IDS, rates=r) == _GOLDEN_V3
    assert rows_nbytes(12240, 48, 1, rates=r, index=_V3_IDS) == len(_GOLDEN_V3)
    # version 2 would take 60 bytes of Elias-Fano ids and 20 of packed rates: 59 and 14
    assert rows_nbytes(12240, 48, 1, rated=False) == 36 + 60 + 48
    assert 2 + -(-48 * rate_width(r) // 8) == 20
    assert len(_GOLDEN_V3) == 36 + 59 + 14 + 48


def _concentrated(g: np.random.Generator, data, count: int) -> np.ndarray:
    """Rate codes as a class's rows have them: around one code, or a few codes of
    skewed counts, or spread (where packing wins)."""
    kind = data.draw(st.sampled_from(["normal", "skewed", "uniform"]))
    if kind == "normal":
        centre, spread = data.draw(st.integers(0, 255)), data.draw(st.floats(0.1, 40))
        r = np.rint(g.normal(centre, spread, count))
    elif kind == "skewed":
        values = g.integers(0, 256, data.draw(st.integers(1, 40)))
        r = values[np.minimum(g.geometric(data.draw(st.floats(0.05, 0.95)), count) - 1,
                              len(values) - 1)]
    else:
        r = g.integers(0, 256, count)
    return np.clip(r, 0, 255).astype(np.uint8)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 140000), st.data())
def test_rice_ids_and_huffman_rates_round_trip(nrows, data):
    count = data.draw(st.integers(1, min(nrows, 4000)))
    g = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    if data.draw(st.booleans()):
        idx = np.sort(g.choice(nrows, size=count, replace=False))
    else:  # runs of neighbouring rows
        idx = np.unique(np.clip(np.repeat(g.integers(0, nrows, -(-count // 8)), 8)
                                + np.tile(np.arange(8), -(-count // 8)), 0, nrows - 1))
        count = len(idx)
    rates = _concentrated(g, data, count)
    codes = g.integers(0, 256, size=(count, 2), dtype=np.uint8)
    head, p = _round_trip(nrows, codes, idx, rates, step=5, cls=3)
    # the smallest of the encodings, version 3 only where one of its own is smaller
    assert len(p) <= rows_nbytes(nrows, count, 2, rates=rates)
    assert head.body_at - head.rates_at <= 2 + -(-count * rate_width(rates) // 8)
    if head.rated_mode == RATED_HUFF:
        assert head.body_at - head.rates_at < 2 + -(-count * rate_width(rates) // 8)


def test_crafted_version_3_ids_and_rates_are_refused():
    def refused(p: bytearray, match: str) -> None:
        with pytest.raises(ManifestError, match=match):
            decode_rows_object(Object(KIND_BLOCK_ROWS, (), bytes(p)))

    v2 = bytearray(_GOLDEN_V3)
    v2[4] = 2  # Rice ids and Huffman rates in a version 2 object
    refused(v2, "version")
    head = read_rows_header_of(_GOLDEN_V3)
    ids, rates = 36, head.rates_at  # the ids' k and unary bit count; the rates' lo and n
    for at, value in ((ids, 32), (ids + 1, 47), (ids + 1, 200)):  # k past 31; bits
        bad = bytearray(_GOLDEN_V3)
        bad[at] = value
        refused(bad, "Rice")
    pad = bytearray(_GOLDEN_V3)
    pad[rates - 1] |= 0x80  # a pad bit past the unary part's 95 bits
    refused(pad, "Rice")
    last = bytearray(_GOLDEN_V3)
    last[rates - 1] &= 0x3F  # the unary part ends in a zero: 47 ids, not 48
    refused(last, "Rice")
    past = bytearray(_GOLDEN_V3)
    past[rates] = 250  # lo + n past 255
    refused(past, "rate codes")
    table = bytearray(_GOLDEN_V3)
    table[rates + 2] = 0x22  # lengths 2, 2, 3, 3: not a complete code
    refused(table, "Huffman")
    odd = bytearray(_GOLDEN_V3)
    odd[rates + 1] = 6  # seven codes: the eighth nibble is padding and is set
    refused(odd, "Huffman")
    tail = bytearray(_GOLDEN_V3)
    tail[head.body_at - 1] |= 0x80  # a pad bit past the 60 bits of codewords
    refused(tail, "Huffman")
    longer = bytearray(_GOLDEN_V3)
    longer[head.body_at:head.body_at] = b"\x00"  # a byte more than the codewords take
    refused(longer, "Huffman")
    shorter = bytearray(_GOLDEN_V3)
    del shorter[head.body_at - 1]  # the codewords run past the section
    refused(shorter, "Huffman")


def read_rows_header_of(payload: bytes):
    from cnrstore.format.rowlists import read_rows_header
    return read_rows_header(Object(KIND_BLOCK_ROWS, (), payload))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_damaged_version_3_sections_are_refused_or_read_whole(data):
    # any bytes in the ids' and rates' sections, any length: a ManifestError or ids and
    # rates a reader can use, never another error or a read past the payload
    p = bytearray(_GOLDEN_V3)
    for _ in range(data.draw(st.integers(1, 4))):
        p[data.draw(st.integers(36, 108))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(-3, 3))
    at = data.draw(st.integers(37, 108))
    if cut < 0:
        del p[at:at - cut]
    else:
        p[at:at] = bytes(data.draw(st.lists(st.integers(0, 255), min_size=cut,
                                            max_size=cut)))
    try:
        head, idx, rates, got = decode_rows_object(Object(KIND_BLOCK_ROWS, (), bytes(p)))
    except ManifestError:
        return
    assert len(rates) == head.count and got is not None and len(got) == head.count
    if idx is not None:
        assert len(idx) == head.count and (np.diff(idx) > 0).all()
        assert head.count == 0 or 0 <= idx[0] and idx[-1] < head.nrows


def test_rice_ids_take_less_than_elias_fano_where_objects_are_large():
    # the ids of one class's object of a 131072-row block: ~0.4 bits an id less from
    # 500 rows, where the replay's 5% objects hold ~1300
    g = np.random.default_rng(4)
    for count, most in ((500, 0.97), (1300, 0.96), (20000, 0.9)):
        idx = np.sort(g.choice(131072, size=count, replace=False))
        rice = rows_nbytes(131072, count, 0, rated=False, index=idx) - 36
        ef = rows_nbytes(131072, count, 0, rated=False) - 36
        assert rice <= most * ef


def _v3_run(path, reopen: bool) -> tuple[list, set]:
    """20 steps of ~1000 Zipf-drawn rows of one 8192-row block (objects of hundreds of
    rows: Rice ids and Huffman rates pay there), the handle kept or reopened before every
    put: each step's table ids and the (version, ids, rated) of the objects listed."""
    from cnrstore.format.rowlists import read_rows_header

    g = np.random.default_rng(11)
    x = torch.zeros(8192, 2)
    ids, kinds = [], set()
    s = cnrstore.open(path, block_rows=8192, layout="grouped")
    try:
        s.put_tables(0, {"t": x})
        for step in range(1, 21):
            rows = np.unique(np.minimum(g.zipf(1.2, 1500), 1 << 15) * 7919 % 8192)
            x[torch.from_numpy(rows)] += 1.0
            if reopen:
                s.close()
                s = cnrstore.open(path)
            ids.append(s.put_tables(step, {"t": x}).tables)
            (oid,) = load_manifest(s.objects, step).tables["t"].block_ids
            for ref in read_list(s.objects.get, oid).refs:
                h = read_rows_header(s.objects.get(ref))
                kinds.add((h.version, h.ids, h.rated_mode))
        assert_identical(s.get_tables(20)["t"], x)
    finally:
        s.close()
    return ids, kinds


def test_version_3_objects_seed_a_reopened_writer_as_one_that_never_closed(tmp_path):
    # the writer's state rebuilt from Rice ids and Huffman-coded rates decides as the
    # state it kept: the same objects and lists at every step
    kept, kinds = _v3_run(tmp_path / "a", False)
    reopened, _ = _v3_run(tmp_path / "b", True)
    assert kept == reopened
    # Rice ids and Huffman rates both seed it, if not in one object: a class's rows hold
    # a few distinct counts of changes, which packed codes often take in fewer bytes
    assert {(3, IDS_EF, RATED_HUFF), (2, IDS_EF, RATED_PACKED)} <= kinds
    assert any(k[1] == IDS_RICE for k in kinds)


def test_a_list_that_leaves_a_row_without_a_copy_is_refused():
    codes = np.arange(16 * 4, dtype=np.uint8).reshape(16, 4)
    objs = {}
    chunk = encode_rows(16, codes[:8], step=0, cls=0, start=0)
    objs[b"c" * 16] = Object(KIND_BLOCK_ROWS, (), chunk)
    payload, refs = encode_list((b"c" * 16,), np.array([0]), np.array([8]), np.array([0]))
    objs[b"l" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    with pytest.raises(ManifestError, match="no copy"):
        resolve(objs.__getitem__, b"l" * 16)
    rest = encode_rows(16, codes[8:], step=1, cls=1, index=np.arange(8, 16))
    objs[b"r" * 16] = Object(KIND_BLOCK_ROWS, (), rest)
    payload, refs = encode_list((b"c" * 16, b"r" * 16), np.array([0, 1]), np.array([8, 8]),
                                np.array([0, 1]))
    objs[b"m" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    assert np.array_equal(resolve(objs.__getitem__, b"m" * 16), codes)
    payload, refs = encode_list((b"c" * 16, b"r" * 16), np.array([0, 2]), np.array([8, 8]),
                                np.array([0, 1]))
    objs[b"x" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    with pytest.raises(ManifestError, match="list entry"):
        resolve(objs.__getitem__, b"x" * 16)


def _delta_store():
    """Block of 16 rows of 4 bytes: full list "l" (two chunks), delta "d" of it that drops
    the second chunk for its rows written again, and the codes "d" stands for."""
    codes = np.arange(16 * 4, dtype=np.uint8).reshape(16, 4)
    objs = {}
    objs[b"c" * 16] = Object(KIND_BLOCK_ROWS, (), encode_rows(16, codes[:8], step=0, cls=0))
    objs[b"e" * 16] = Object(KIND_BLOCK_ROWS, (), encode_rows(16, codes[8:], step=0, cls=0,
                                                              start=8))
    payload, refs = encode_list((b"c" * 16, b"e" * 16), np.array([0, 0]), np.array([8, 8]),
                                np.array([0, 0]))
    objs[b"l" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    codes = codes.copy()
    codes[8:] += 1
    objs[b"r" * 16] = Object(KIND_BLOCK_ROWS, (), encode_rows(16, codes[8:], step=1, cls=1,
                                                              index=np.arange(8, 16)))
    payload, refs = encode_list_delta(b"l" * 16, 2 * len(objs[b"c" * 16].payload),
                                      np.array([1]), (b"r" * 16,), np.array([1]),
                                      np.array([8]), np.array([1]))
    objs[b"d" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    return objs, codes


class _Info:
    def __init__(self, obj: Object):
        self.kind, self.refs, self.raw_len = obj.kind, obj.refs, len(obj.payload)


def test_a_delta_list_reads_its_base_but_the_dropped_entries():
    objs, codes = _delta_store()
    entries = read_list(objs.__getitem__, b"d" * 16)
    assert entries.refs == (b"c" * 16, b"r" * 16) and entries.base == b"l" * 16
    read = []
    assert np.array_equal(resolve(lambda o: read.append(o) or objs[o], b"d" * 16), codes)
    assert b"e" * 16 not in read  # dropped: in the closure (the base names it), not read
    plan_list(lambda o: _Info(objs[o]), b"d" * 16, 16, 4)


def test_a_delta_of_a_delta_or_past_its_base_is_refused():
    objs, _ = _delta_store()
    payload, refs = encode_list_delta(b"d" * 16, 0, np.array([], dtype=np.int64), (),
                                      np.array([]), np.array([]), np.array([]))
    objs[b"x" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    with pytest.raises(ManifestError, match="not a full list"):
        resolve(objs.__getitem__, b"x" * 16)
    with pytest.raises(ManifestError, match="not a row object"):
        plan_list(lambda o: _Info(objs[o]), b"x" * 16, 16, 4)
    payload, refs = encode_list_delta(b"l" * 16, 0, np.array([2]), (), np.array([]),
                                      np.array([]), np.array([]))
    objs[b"y" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    with pytest.raises(ManifestError, match="out of range"):
        resolve(objs.__getitem__, b"y" * 16)


def test_the_default_layout_writes_no_list(tmp_path):
    with cnrstore.open(tmp_path / "s", block_rows=64) as s:
        t = _tables(4)
        s.put_tables(0, t)
        for step in range(1, 6):
            t["a"][step] += 1
            s.put_tables(step, t)
        for tm in load_manifest(s.objects, 5).tables.values():
            assert all(s.objects.info(o).kind != KIND_BLOCK_LIST for o in tm.block_ids)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_batched_resolve_gives_what_resolve_list_gives(data):
    # lists of version 1 and 2 row objects (spans and id sets), full and delta, applied
    # by resolve_list with get_many (all objects read together) and without (one get each)
    from cnrstore.format.rowlists import resolve_list

    n = data.draw(st.integers(1, 80))
    rnb, elem = data.draw(st.sampled_from([(4, 1), (4, 4), (6, 2), (3, 1)]))
    g = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    objs: dict[bytes, Object] = {}
    refs, cls, rows, steps = [], [], [], []
    writes: list[tuple[np.ndarray, np.ndarray]] = []  # the plain model: (rows, codes)

    def add(payload: bytes, c: int, count: int, step: int) -> None:
        oid = bytes([len(objs)]) * 16
        objs[oid] = Object(KIND_BLOCK_ROWS, (), payload)
        refs.append(oid), cls.append(c), rows.append(count), steps.append(step)

    first = g.integers(0, 256, (n, rnb), dtype=np.uint8)
    add(encode_rows(n, first, step=0, cls=0, elem=elem), 0, n, 0)
    writes.append((np.arange(n), first))
    for step in range(1, data.draw(st.integers(0, 6)) + 1):
        count = data.draw(st.integers(1, n))
        idx = np.sort(g.choice(n, size=count, replace=False))
        codes = g.integers(0, 256, (count, rnb), dtype=np.uint8)
        if data.draw(st.booleans()):  # a span
            start = data.draw(st.integers(0, n - count))
            add(encode_rows(n, codes, step=step, cls=1, elem=elem, start=start), 1, count,
                step)
            writes.append((np.arange(start, start + count), codes))
        else:
            rates = g.integers(0, 256, count).astype(np.uint8)
            p = encode_rows(n, codes, step=step, cls=2, elem=elem, index=idx, rates=rates)
            if data.draw(st.booleans()) and n <= 1 << 16 and elem == 1:  # version 1
                head = bytearray(p[:36])
                head[4], head[5], head[7] = 1, 1, 1  # u16 ids, u8 rates
                p = (bytes(head) + idx.astype("<u2").tobytes() + rates.tobytes()
                     + codes.tobytes())
            add(p, 2, count, step)
            writes.append((idx, codes))
    payload, lrefs = encode_list(tuple(refs), np.array(cls), np.array(rows),
                                 np.array(steps))
    objs[b"L" * 16] = Object(KIND_BLOCK_LIST, lrefs, payload)
    top = b"L" * 16
    if len(refs) > 1 and data.draw(st.booleans()):  # a delta dropping the last entry
        row0 = g.integers(0, 256, (1, rnb), dtype=np.uint8)
        extra = encode_rows(n, row0, step=99, cls=3, elem=elem, index=np.array([0]))
        writes[-1:] = [(np.array([0]), row0)]
        objs[b"X" * 16] = Object(KIND_BLOCK_ROWS, (), extra)
        payload, drefs = encode_list_delta(top, 0, np.array([len(refs) - 1]), (b"X" * 16,),
                                           np.array([3]), np.array([1]), np.array([99]))
        objs[b"D" * 16] = Object(KIND_BLOCK_LIST, drefs, payload)
        top = b"D" * 16
    asked = []

    def get_many(oids):
        asked.append(tuple(oids))
        return [objs[o] for o in oids]

    try:
        want = resolve_list(objs.__getitem__, top)
    except ManifestError as exc:  # a delta dropping a row's only copy, say
        with pytest.raises(ManifestError, match=str(exc).split(":")[0][:20]):
            resolve_list(objs.__getitem__, top, get_many=get_many)
        return
    model = np.zeros((n, rnb), dtype=np.uint8)
    covered = np.zeros(n, dtype=bool)
    for at, codes in writes:  # a row's value: its copy in the last object holding it
        model[at], covered[at] = codes, True
    assert covered.all() and np.array_equal(want, model)
    got = resolve_list(objs.__getitem__, top, get_many=get_many)
    assert np.array_equal(got, want) and len(asked) == 1
    out = np.zeros_like(want)
    assert resolve_list(objs.__getitem__, top, out=out, get_many=get_many) is out
    assert np.array_equal(out, want)


# Counts of changes: a block whose lists carry "born" holds counts of changes since that
# step in its objects' rate codes; lists without it (older stores) keep rates.


def test_lists_carry_the_step_their_block_was_born():
    objs, _ = _delta_store()
    assert read_list(objs.__getitem__, b"d" * 16).born is None  # as stores before it
    payload, refs = encode_list((b"c" * 16, b"e" * 16), np.array([0, 0]), np.array([8, 8]),
                                np.array([0, 0]), born=7)
    objs[b"b" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    assert read_list(objs.__getitem__, b"b" * 16).born == 7
    payload, refs = encode_list_delta(b"b" * 16, 1, np.array([1]), (b"r" * 16,),
                                      np.array([1]), np.array([8]), np.array([1]), born=-3)
    objs[b"f" * 16] = Object(KIND_BLOCK_LIST, refs, payload)
    assert read_list(objs.__getitem__, b"f" * 16).born == -3
    bad = msgpack.packb({**msgpack.unpackb(objs[b"b" * 16].payload), "born": "x"})
    objs[b"x" * 16] = Object(KIND_BLOCK_LIST, objs[b"b" * 16].refs, bad)
    with pytest.raises(ManifestError, match="born"):
        read_list(objs.__getitem__, b"x" * 16)


def _counted_store():
    """A 64-row block born at step 0 (one chunk), then rows 1, 5, 6, 60 at step 9 with
    counts 1, 2, 1, 3, under a list with "born"."""
    counted = encode_rows(64, _CODES, step=9, cls=2, index=np.array([1, 5, 6, 60]),
                          rates=np.array([1, 2, 1, 3], np.uint8))
    return _chunk_and_object(counted, born=0)[0]


def test_a_list_with_born_seeds_counts():
    group = grouppolicy.load_group(_counted_store().__getitem__, b"l" * 16, 64, 3)
    assert group is not None and group.born == 0
    assert group.rq[[1, 5, 6, 60]].tolist() == [1, 2, 1, 3] and group.rq[0] == 255
    gw = grouppolicy.next_group(group, np.array([0, 5]), 10, 3)
    assert gw.group.born == 0 and gw.group.rq[[0, 5]].tolist() == [1, 3]


def test_a_list_without_born_keeps_rates():
    # a block of a store written before counts: its rates decay as they always did
    objs, _ = _chunk_and_object(_GOLDEN_V2)
    group = grouppolicy.load_group(objs.__getitem__, b"l" * 16, 64, 3)
    assert group is not None and group.born is None
    gw = grouppolicy.next_group(group, np.array([5]), 12, 3)
    a = grouppolicy.ALPHA
    want = rate_code(rate_value(np.array([16])) * (1 - a) ** 3 + a)
    assert gw.group.born is None and gw.group.rq[5] == want[0]


@settings(max_examples=200, deadline=None)
@given(born=st.integers(-5, 5), changes=st.lists(st.booleans(), min_size=1, max_size=1600),
       extra=st.sets(st.integers(1, 1600)), data=st.data())
def test_a_count_is_the_same_however_often_its_row_was_written(born, changes, extra, data):
    # the writer's state is a function of what is stored: a row written at every step
    # (a copy each time) and one written only when it changed (and at ``extra`` steps,
    # the cleaner's copies) have the same count and rate at every step
    every = np.full(1, 255, np.uint8)
    sparse, at = np.full(1, 255, np.uint8), born
    for t, changed in enumerate(changes, start=born + 1):
        ch = np.array([0]) if changed else np.zeros(0, np.int64)
        r1, every = grouppolicy.counted_rates(every, np.array([t - 1]), ch, t, born)
        r2, c2 = grouppolicy.counted_rates(sparse, np.array([at]), ch, t, born)
        assert every.tolist() == c2.tolist() and r1.tolist() == r2.tolist()
        if changed or t - born in extra:
            sparse, at = c2, t
    assert every[0] <= grouppolicy.COUNT_CAP


def test_counts_halve_at_each_epoch():
    e, born = grouppolicy.COUNT_EPOCH, 3
    none = np.zeros(0, np.int64)
    rate, n = grouppolicy.counted_rates(np.array([9], np.uint8), np.array([born + 1]), none,
                                        born + e - 1, born)
    assert n[0] == 9 and rate[0] == 9 / (e - 1 + grouppolicy.COUNT_PRIOR)
    rate, n = grouppolicy.counted_rates(np.array([9], np.uint8), np.array([born + 1]), none,
                                        born + 2 * e + 10, born)
    assert n[0] == 2 and rate[0] == 2 / (10 + e * 0.75 + grouppolicy.COUNT_PRIOR)
    _, n = grouppolicy.counted_rates(np.array([254], np.uint8), np.array([born]),
                                     np.array([0]), born + 1, born)
    assert n[0] == grouppolicy.COUNT_CAP  # capped, never the 255 of "no count yet"


# Frozen: a full list with "born" as writers write it since 2026-12-07; stores hold it,
# so it must read (and write) as it is.
_GOLDEN_BORN_LIST = bytes.fromhex(
    "85a17601a3636c73c4020002a4726f7773c4084000000004000000a473746570c4100000000000000000"
    "0900000000000000a4626f726e00")


def test_golden_born_list_still_reads():
    objs = _counted_store()
    assert objs[b"l" * 16].payload == _GOLDEN_BORN_LIST
    assert read_list(objs.__getitem__, b"l" * 16).born == 0

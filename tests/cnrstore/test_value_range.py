"""Values beyond fp16's range are never damaged silently (issue 8, item 5): intN rows whose
scale/offset do not fit fp16 are stored with fp32 qparams; the fp16 cast, and any range
that even fp32 qparams cannot hold, is refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import make_store

import cnrstore
from cnrstore.codec.quantize import GREEDY_MAX_BITS, row_nbytes, scheme_bits
from cnrstore.format.load import load_manifest


@pytest.fixture(params=["memory", "pack"])
def store(request, tmp_path):
    s = make_store(request.param, tmp_path / "ckpt", block_rows=8, fanout=4)
    yield s
    s.close()


def _table(dtype=torch.float32, rows=24, width=16):
    g = torch.Generator().manual_seed(7)
    t = torch.randn(rows, width, generator=g, dtype=torch.float64)
    t[3] = 1e5 + torch.randn(width, generator=g, dtype=torch.float64)         # Adagrad-like
    t[9] = 1e30 * (1 + 0.1 * torch.randn(width, generator=g, dtype=torch.float64))
    t[17] = -1e30 * (1 + 0.1 * torch.randn(width, generator=g, dtype=torch.float64))
    t[20] = 7e4 * torch.randn(width, generator=g, dtype=torch.float64)       # wide range
    return t.to(dtype)


def _assert_within_bound(got, want, scheme):
    """Per row: the codes' rounding (scale / 2, scale = range / levels), plus what the
    adaptive search may clip for <= 4 bits (at most 16% of the range), plus float32 slack."""
    bits = scheme_bits(scheme)
    x = want.double()
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    span = hi - lo
    clip = 0.16 if bits <= GREEDY_MAX_BITS else 0.0
    out = 2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-20  # rounding to the dtype
    bound = span * (clip + 0.5 / ((1 << bits) - 1)) * (1 + 1e-3) + x.abs().amax(dim=1) * out
    err = (got.double() - x).abs().amax(dim=1)
    assert bool((err <= bound).all()), [(i, float(e), float(b)) for i, (e, b) in
                                        enumerate(zip(err, bound)) if e > b]


@pytest.mark.parametrize("scheme", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_intn_rows_beyond_fp16_restore_within_the_error_bound(store, scheme, dtype):
    t = _table(dtype)
    store.put_tables(1, {"t": t}, quant=scheme)
    got = store.get_tables(1)["t"]
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    _assert_within_bound(got, t, scheme)
    node = load_manifest(store.objects, 1).tables["t"].node
    assert node.row_nbytes == row_nbytes(scheme, dtype, 16) + 4  # fp32 scale and offset
    assert store.verify().ok


def test_tables_within_fp16_keep_fp16_qparams_and_a_table_turns_wide_once(store):
    g = torch.Generator().manual_seed(8)
    t = torch.randn(24, 16, generator=g)
    store.put_tables(1, {"t": t}, quant="int8")
    narrow = row_nbytes("int8", torch.float32, 16)
    assert load_manifest(store.objects, 1).tables["t"].node.row_nbytes == narrow
    t[5] = 2e5 + torch.randn(16, generator=g)
    info = store.put_tables(2, {"t": t}, quant="int8")
    assert info.rows_written == {"t": 24}  # re-encoded with fp32 qparams: a new encoding
    assert load_manifest(store.objects, 2).tables["t"].node.row_nbytes == narrow + 4
    _assert_within_bound(store.get_tables(2)["t"], t, "int8")
    t[5] = torch.randn(16, generator=g)  # back in range: stays wide, stays incremental
    t[11] += 1
    info = store.put_tables(3, {"t": t}, quant="int8")
    assert info.rows_written == {"t": 2}
    _assert_within_bound(store.get_tables(3)["t"], t, "int8")
    _assert_within_bound(store.get_tables(1)["t"], store.get_tables(1)["t"], "int8")


@pytest.mark.parametrize("value", [1e5, -7e4, 1e30])
def test_fp16_cast_refuses_values_beyond_its_range_and_writes_nothing(store, value):
    g = torch.Generator().manual_seed(9)
    ok = torch.randn(10, 4, generator=g)
    store.put_tables(1, {"t": ok}, quant="fp16")
    before = (store.steps(), store.stats().objects)
    bad = ok.clone()
    bad[6, 2] = value
    with pytest.raises(cnrstore.ValueOutOfRange) as err:
        store.put_tables(2, {"t": bad}, quant="fp16")
    e = err.value
    assert isinstance(e, cnrstore.InvalidInput)
    assert (e.table, e.row, e.scheme) == ("t", 6, "fp16")
    assert "'t'" in str(e) and "row 6" in str(e) and "NaN" not in str(e)
    assert (store.steps(), store.stats().objects) == before
    ok[1] += 1  # the diff base survived the refusal
    assert store.put_tables(2, {"t": ok}, quant="fp16").rows_written == {"t": 1}


def test_bf16_cast_keeps_fp32_range(store):
    t = _table(torch.float32)
    store.put_tables(1, {"t": t}, quant="bf16")
    assert torch.equal(store.get_tables(1)["t"], t.bfloat16().float())


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16", "fp16"])
@pytest.mark.parametrize("value", [1e300, -1e300])
def test_float64_beyond_float32_is_refused_as_out_of_range_not_nan(store, scheme, value):
    t = torch.randn(12, 4, dtype=torch.float64)
    t[8] = value
    with pytest.raises(cnrstore.ValueOutOfRange) as err:
        store.put_tables(1, {"t": t}, quant=scheme)
    assert err.value.row == 8 and "NaN" not in str(err.value)
    assert store.steps() == []

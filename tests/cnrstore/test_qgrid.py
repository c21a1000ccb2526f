"""The "grid" range search (cnrstore/codec/qgrid.py), int2-int4's default: never worse than
min/max on any row (the encoder's own error, Hypothesis over dtypes, widths and row
shapes), and in total no worse than Check-N-Run's greedy walk, which it replaced as the
default because it costs a third as much (docs/QUANTIZATION.md, "Grid search")."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.codec import qgrid, qsearch
from cnrstore.codec.qparams import dequantize, fp16_qparams, quantize_codes
from cnrstore.codec.quantize import LOSSY_DTYPES, decode_rows, encode_rows

INT_SCHEMES = ("int4", "int3", "int2")


def _sq_err(rows, scheme, search=None):
    back = decode_rows(encode_rows(rows, scheme, search=search), scheme, rows.dtype,
                       rows.shape[1])
    return ((back.double() - rows.double()) ** 2).sum(1)


def _rows(kind, n, width, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=gen, dtype=torch.float64)
    if kind == "outliers":
        x[:, 0] *= 25
    elif kind == "constant":
        x[::2] = 0.375
    elif kind == "integers":
        x = x.mul(3).round()
    elif kind == "tiny":
        x *= 1e-6
    elif kind == "symmetric":
        x[:, : width // 2] = -x[:, width - width // 2:][:, : width // 2]
    elif kind == "scaled":
        x *= torch.logspace(-3, 3, n, dtype=torch.float64)[:, None]
    return x.to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    scheme=st.sampled_from(INT_SCHEMES + ("int8",)),
    dtype=st.sampled_from(LOSSY_DTYPES),
    kind=st.sampled_from(["gauss", "outliers", "constant", "integers", "tiny", "symmetric",
                          "scaled"]),
    n=st.integers(1, 300),
    width=st.integers(1, 80),
    seed=st.integers(0, 2**31),
    numpy_path=st.booleans(),
)
def test_grid_is_never_worse_than_minmax_on_any_row(scheme, dtype, kind, n, width, seed,
                                                    numpy_path, monkeypatch_module):
    monkeypatch_module.setattr(qsearch, "_NUMPY_CPU", numpy_path)  # numpy or torch search
    rows = _rows(kind, n, width, seed, dtype)
    assert torch.all(_sq_err(rows, scheme, "grid") <= _sq_err(rows, scheme, "minmax"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("scheme", INT_SCHEMES)
@pytest.mark.parametrize("dist", ["gauss", "uniform", "student_t", "outliers"])
def test_grid_total_error_is_no_worse_than_the_greedy_walk(scheme, dist):
    gen = torch.Generator().manual_seed(11)
    if dist == "uniform":
        rows = torch.rand(3000, 64, generator=gen)
    elif dist == "student_t":
        torch.manual_seed(11)
        rows = torch.distributions.StudentT(3.0).sample((3000, 64))
    else:
        rows = torch.randn(3000, 64, generator=gen)
        if dist == "outliers":
            rows[::3, 5] *= 20
    grid, greedy = _sq_err(rows, scheme).sum(), _sq_err(rows, scheme, "greedy").sum()
    assert grid <= greedy, (float(grid), float(greedy))


@pytest.mark.parametrize("scheme", INT_SCHEMES)
def test_numpy_and_torch_grid_search_agree_in_error(scheme, monkeypatch):
    rows = torch.randn(2000, 48, generator=torch.Generator().manual_seed(12))
    numpy_err = _sq_err(rows, scheme)
    monkeypatch.setattr(qsearch, "_NUMPY_CPU", False)
    torch_err = _sq_err(rows, scheme)
    # Same candidates; float sums in another order may tip near-ties, never the total.
    assert abs(float(numpy_err.sum() / torch_err.sum()) - 1) < 1e-3


def test_grid_is_the_default_below_int8_and_wide_rows_still_work():
    rows = torch.randn(500, 16, generator=torch.Generator().manual_seed(13))
    assert torch.equal(encode_rows(rows, "int4"), encode_rows(rows, "int4", search="grid"))
    assert torch.equal(encode_rows(rows, "int8"), encode_rows(rows, "int8", search="minmax"))
    wide = rows * 1e6  # beyond fp16 qparams: fp32 qparams, searched by the torch path
    back = decode_rows(encode_rows(wide, "int4", wide=True), "int4", torch.float32, 16)
    mm = decode_rows(encode_rows(wide, "int4", wide=True, search="minmax"), "int4",
                     torch.float32, 16)
    e, e_mm = ((back.double() - wide.double()) ** 2).sum(1), ((mm.double() - wide.double())
                                                              ** 2).sum(1)
    assert torch.all(e <= e_mm) and e.sum() < e_mm.sum()


def test_non_finite_rows_are_refused_by_name():
    rows = torch.randn(40, 8)
    rows[17, 3] = float("nan")
    with pytest.raises(ValueError, match="row 17 "):
        encode_rows(rows, "int3")


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(LOSSY_DTYPES), bits=st.sampled_from([2, 3, 4]),
       magnitude=st.sampled_from([1e-3, 1.0, 3e4, 6.5e4, 1e5]), n=st.integers(1, 40),
       width=st.integers(1, 24), seed=st.integers(0, 2**31))
def test_numpy_decoded_rows_are_the_encoders_bit_for_bit(dtype, bits, magnitude, n, width,
                                                         seed):
    """The grid's final comparison decodes rows in numpy, and skips the +-FP16_MAX clamp
    where no row can reach it: its values are still the encoder's and decoder's own,
    near the limit too (rows up to 65504, whose top code rounds past it)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, width, generator=gen) * 2 - 1) * magnitude
    x = x.clamp(-65504.0, 65504.0).to(dtype).float()
    scale, offset = fp16_qparams(x.amin(1), x.amax(1), bits)
    want = dequantize(quantize_codes(x, scale, offset, bits), scale, offset).to(dtype)
    got = qgrid._decoded(x.numpy(), scale.numpy(), offset.numpy(), bits, dtype)
    got_t = torch.from_numpy(got).to(dtype)  # bf16: float32 with the low half zeroed
    assert torch.equal(got_t.float().view(torch.int32), want.float().view(torch.int32))

"""The compiled int8 encode (codec/_kernels.c via native.py) against the torch encode it
replaces on the CPU: the same bytes for every row, the same refusals (issue 27: a put's
stored bytes must not change)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ckpt_util import without_native_kernels
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cnrstore.codec import native, quantize


@pytest.fixture(scope="module")
def kernels():
    k = native.kernel(wait=True)
    if k is None or k.encode_int8 is None:
        pytest.skip(f"no native int8 encode here: {native.status()['reason']}")
    return k


def _both(rows: torch.Tensor):
    """(compiled, torch) results of encode_rows(rows, "int8"): codes or the error's repr."""
    def run():
        try:
            return quantize.encode_rows(rows, "int8")
        except ValueError as exc:
            return repr(exc)

    calls = []
    real = quantize._encode_int8_native

    def spy(*args):
        try:
            calls.append(real(*args))
        except ValueError:
            calls.append(True)  # the kernel ran and refused the rows
            raise
        return calls[-1]

    quantize._encode_int8_native = spy
    try:
        fast = run()
    finally:
        quantize._encode_int8_native = real
    with without_native_kernels():
        ref = run()
    return fast, ref, calls


def _same(fast, ref) -> bool:
    if isinstance(fast, torch.Tensor) and isinstance(ref, torch.Tensor):
        return torch.equal(fast, ref)
    return fast == ref


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 40), width=st.integers(1, 70), seed=st.integers(0, 2**31),
       scale=st.sampled_from([1e-30, 1e-7, 1e-3, 1.0, 300.0, 2e4, 7e4, 1e38]),
       special=st.sampled_from([None, "nan", "inf", "-inf", "zeros", "negzero", "const"]))
@example(n=3, width=1, seed=0, scale=1.0, special="negzero")
def test_compiled_int8_encode_matches_torch(kernels, n, width, seed, scale, special):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, width, generator=g) * scale
    if special in ("nan", "inf", "-inf"):
        rows[n // 2, width // 2] = float(special)
    elif special == "zeros":
        rows[: n // 2 + 1] = 0.0
    elif special == "negzero":
        rows[0] = -0.0
        rows[0, 0] = 0.0
    elif special == "const":
        rows[:] = rows[0, 0]
    fast, ref, calls = _both(rows)
    assert calls == [True]  # the compiled kernel encoded (or refused) these rows
    assert _same(fast, ref), (fast, ref)


def test_compiled_int8_encode_is_used_only_where_it_applies(kernels):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(30, 16, generator=g)
    for rows, used in ((base, True), (base[:, ::2], False), (base[::3], True),
                       (base.double(), False), (base.half(), False)):
        fast, ref, calls = _both(rows)
        assert calls == [used] and _same(fast, ref)
    wide = quantize.encode_rows(base * 1e6, "int8", wide=True)  # fp32 qparams: torch path
    assert wide.shape == (30, 16 + 8)


def test_a_table_of_realistic_rows_encodes_to_the_same_bytes(kernels):
    g = torch.Generator().manual_seed(2)
    rows = (torch.rand(20000, 64, generator=g) - 0.5) * (2 / np.sqrt(20000))
    fast, ref, calls = _both(rows)
    assert calls == [True] and torch.equal(fast, ref)

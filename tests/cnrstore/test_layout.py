"""cnrstore.codec.layout: the torch-free dtype table and row sizes agree with torch and with
what the encoder writes (a reader checks nodes by these numbers before it allocates)."""

from __future__ import annotations

import pytest
import torch

from cnrstore.codec import layout
from cnrstore.codec.quantize import LOSSY_DTYPES, encode_rows, row_nbytes


def test_dtype_sizes_are_torchs():
    for name, size in layout.DTYPE_SIZES.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            assert torch.empty((), dtype=dtype).element_size() == size, name
    assert set(layout.DTYPES) <= set(layout.DTYPE_SIZES)
    assert {layout.dtype_name(d) for d in LOSSY_DTYPES} == set(layout.LOSSY_DTYPE_NAMES)


@pytest.mark.parametrize("scheme", layout.SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 64])
def test_row_sizes_by_name_match_the_encoder(scheme, dtype, width):
    rows = torch.randn(3, width).to(dtype)
    name = layout.dtype_name(dtype)
    got = encode_rows(rows, scheme).shape[1]
    assert got == row_nbytes(scheme, dtype, width) == layout.row_nbytes_of(scheme, name, width)
    assert got in layout.row_nbytes_options_of(scheme, name, width)


def test_lossy_schemes_refuse_integer_tables_by_name():
    with pytest.raises(ValueError, match="lossy"):
        layout.check_scheme_name("int8", "int64", table="t")
    layout.check_scheme_name("exact", "int64", table="t")

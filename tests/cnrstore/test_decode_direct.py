"""intN rows decoded straight into a float32 table give the bits the float32 temporary
path (``dequantize`` then a copy) gives, narrow and wide rows alike."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.codec.bitpack import unpack_codes
from cnrstore.codec.qparams import dequantize
from cnrstore.codec.quantize import decode_rows, encode_rows


@settings(max_examples=40, deadline=None)
@given(scheme=st.sampled_from(["int8", "int4", "int3", "int2"]), n=st.integers(1, 300),
       width=st.integers(1, 40), wide=st.booleans(), seed=st.integers(0, 99),
       mag=st.sampled_from([1e-3, 1.0, 3e4, 1e6]))
def test_direct_decode_matches_the_temporary_path(scheme, n, width, wide, seed, mag):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * mag
    wide = wide or mag > 1e3
    codes = encode_rows(x, scheme, wide=wide)
    got = decode_rows(codes, scheme, torch.float32, width)
    head = 8 if wide else 4
    raw = codes[:, :head].reshape(-1).clone()
    params = raw.view(torch.float32 if wide else torch.float16).view(n, 2).to(torch.float32)
    bits = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}[scheme]
    q = unpack_codes(codes[:, head:], bits, width)
    limit = torch.finfo(torch.float32).max if wide else 65504.0
    want = dequantize(q, params[:, 0:1], params[:, 1:2], limit=limit)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))

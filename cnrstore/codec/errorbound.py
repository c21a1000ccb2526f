"""The error bound of the lossy schemes: how far a decoded value may lie from the value
that was encoded (docs/QUANTIZATION.md, "Error bound"). The tests hold every encode path
to it; it lives apart from the codec so the codec module stays small."""

from __future__ import annotations

import torch

from cnrstore.codec.qparams import fits_fp16, fp16_qparams, fp32_qparams
from cnrstore.codec.quantize import _BITS, _CASTS, _check_rows, check_scheme

__all__ = ["max_abs_error"]

# Relative rounding slack of the float32 encode/decode arithmetic (a few ulps, see
# docs/QUANTIZATION.md "Error bound") and the output rounding of each table dtype.
_F32_SLACK = 2.0**-21
_OUT_REL = {
    torch.float32: 0.0,
    torch.float64: 0.0,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
_OUT_ABS = {
    torch.float32: 0.0,
    torch.float64: 0.0,
    torch.float16: 2.0**-25,
    torch.bfloat16: 2.0**-134,
}


def max_abs_error(scheme: str, rows: torch.Tensor) -> torch.Tensor:
    """Per-row float64 bound [n] on |decode(encode(rows, search="minmax")) - rows|.

    Holds for finite rows (intN rows beyond +-FP16_MAX with the fp32 scale/offset of wide
    rows; the fp16 cast refuses such rows).
    intN: scale / 2 + slack * (|offset| + levels * scale) + output rounding of the dtype;
    fp16/bf16: the half-ulp of the cast; exact: 0.
    """
    _check_rows(rows)
    check_scheme(scheme, rows.dtype, table="<max_abs_error>")
    n = rows.shape[0]
    x = rows.to(torch.float64)
    if scheme == "exact" or rows.shape[1] == 0:
        return torch.zeros(n, dtype=torch.float64, device=rows.device)
    amax = x.abs().amax(dim=1)
    if scheme in _CASTS:
        rel = 2.0**-11 if scheme == "fp16" else 2.0**-8
        tiny = 2.0**-25 if scheme == "fp16" else 2.0**-134
        return amax * rel + tiny + amax * _OUT_REL[rows.dtype] + _OUT_ABS[rows.dtype]
    bits = _BITS[scheme]
    levels = (1 << bits) - 1
    lo, hi = rows.to(torch.float32).amin(dim=1), rows.to(torch.float32).amax(dim=1)
    scale, offset = fp16_qparams(lo, hi, bits)
    if not bool(fits_fp16(lo, hi).all()):  # such a table's rows are all wide
        scale, offset = fp32_qparams(lo, hi, bits)
    scale, offset = scale[:, 0].double(), offset[:, 0].double()
    span = offset.abs() + levels * scale
    return scale / 2 + span * (_F32_SLACK + _OUT_REL[rows.dtype]) + _OUT_ABS[rows.dtype]

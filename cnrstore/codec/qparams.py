"""fp16 per-row quantization parameters and the code arithmetic shared by encode and search.

The encoder, the decoder and the range search must compute exactly the same numbers, on
CPU and CUDA alike, so the arithmetic lives here once, as separate IEEE float32 ops (one op
per kernel, so no fused multiply-add can make the devices disagree).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP16_MAX", "FP32_MAX", "fp16_qparams", "fp32_qparams", "fits_fp16", "quantize_codes",
    "round_codes_", "dequantize", "within_limit",
]

FP16_MAX = 65504.0
FP32_MAX = float(torch.finfo(torch.float32).max)


def fits_fp16(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """bool [n]: fp16 qparams can cover [lo, hi] (so no value of the row saturates)."""
    return (lo >= -FP16_MAX) & (hi <= FP16_MAX)


def fp32_qparams(lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """float32 (scale, offset) [n, 1] covering [lo, hi] per row, for rows fp16 qparams
    cannot cover (docs/QUANTIZATION.md, "Wide rows"): the offset is lo itself (already a
    float32) and the scale (hi - lo) / levels, computed in float64, rounded up to float32,
    so offset + levels * scale >= hi as with fp16 qparams. Rows whose top code would
    decode beyond float32's range get a non-finite scale (the caller refuses them)."""
    levels = (1 << bits) - 1
    lo = lo.reshape(-1, 1).to(torch.float32)
    hi = hi.reshape(-1, 1).to(torch.float32)
    offset = lo + 0.0
    want = (hi.double() - offset.double()).clamp_min(0) / levels
    scale = want.to(torch.float32)
    scale = torch.where(scale.double() < want, torch.nextafter(scale, scale + torch.inf), scale)
    # At least float32's smallest normal: the encoder multiplies by 1 / scale, which is
    # inf for subnormal scales (fp16 qparams never get there: their scale is >= 2^-24).
    scale = torch.where(scale > 0, scale.clamp_min(torch.finfo(torch.float32).tiny), scale)
    top = offset.double() + levels * scale.double()
    scale = torch.where(top.abs() <= FP32_MAX, scale, torch.full_like(scale, torch.inf))
    return scale + 0.0, offset


def fp16_qparams(lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """fp16-representable (scale, offset) as float32 [n, 1] covering [lo, hi] per row.

    The offset is lo rounded down and the scale (hi - offset) / (2^bits - 1) rounded up to
    fp16, so offset + levels * scale >= hi: rounding the parameters never clips a value,
    and the only error left is the code rounding (<= scale / 2). Ranges beyond the fp16
    range are clamped to it (such rows saturate; see docs/QUANTIZATION.md).
    """
    levels = (1 << bits) - 1
    lo = lo.reshape(-1, 1).to(torch.float32).clamp(-FP16_MAX, FP16_MAX)
    hi = hi.reshape(-1, 1).to(torch.float32).clamp(-FP16_MAX, FP16_MAX)
    offset = _fp16_round_down(lo) + 0.0  # + 0.0: a -0.0 offset becomes +0.0, canonical
    scale = _fp16_round_up(((hi - offset).clamp_min(0) / levels).clamp_max(FP16_MAX)) + 0.0
    return scale, offset


def _fp16_round_down(v: torch.Tensor) -> torch.Tensor:
    h = v.to(torch.float16)
    bits = h.view(torch.int16).to(torch.int32)
    hf = h.to(torch.float32)
    # One fp16 step towards -inf: sign-magnitude, so +1 on the magnitude of negatives.
    down = torch.where(hf > 0, bits - 1, torch.where(hf == 0, -32767, bits + 1))
    fixed = torch.where(hf > v, down, bits).to(torch.int16).view(torch.float16)
    return fixed.to(torch.float32)


def _fp16_round_up(v: torch.Tensor) -> torch.Tensor:
    """For 0 <= v <= FP16_MAX."""
    h = v.to(torch.float16)
    bits = h.view(torch.int16).to(torch.int32)
    fixed = torch.where(h.to(torch.float32) < v, bits + 1, bits)
    return fixed.to(torch.int16).view(torch.float16).to(torch.float32)


# Adding then subtracting 1.5 * 2^23 rounds a float32 in [0, 2^22] to the nearest integer,
# ties to even (IEEE round-to-nearest of the add), exactly like torch.round. torch.round
# itself forks intra-op threads even on tiny tensors, which costs ~100x on shared cores.
_ROUND_MAGIC = 12582912.0


def round_codes_(y: torch.Tensor, levels: int, *, out: torch.Tensor | None = None):
    """clamp(round_half_even(y), 0, levels) (= the rounding of the clamped y), into `out`
    (default: in place)."""
    out = y if out is None else out
    torch.clamp(y, 0, levels, out=out)
    out += _ROUND_MAGIC
    out -= _ROUND_MAGIC
    return out


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int):
    """float32 [n, w] -> uint8 codes clamp(round((x - offset) / scale), 0, 2^bits - 1)."""
    levels = (1 << bits) - 1
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = x - offset
    y *= inv
    return round_codes_(y, levels).to(torch.uint8)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, *, limit: float = FP16_MAX
) -> torch.Tensor:
    """Codes (any int or float dtype) [n, w] -> float32 offset + q * scale.

    Clamped to +-limit: with fp16 qparams (limit FP16_MAX) the top code can land above
    FP16_MAX by rounding, which an fp16 table would turn into inf; fp32 qparams pass
    limit=FP32_MAX.
    """
    y = q.to(torch.float32) * scale
    y += offset
    return y.clamp_(-limit, limit)


def within_limit(scale: torch.Tensor, offset: torch.Tensor, qmax: int, limit: float, *,
                 both: torch.Tensor | None = None) -> bool:
    """Whether no row's offset + q * scale (0 <= q <= qmax) can pass +-limit, rounding
    included (float32 rounds each of the two steps by at most 2^-24 relatively): then
    dequantize's clamp changes nothing and a caller may skip its pass over the rows.
    False for NaN qparams. ``both``: a tensor holding exactly the values of scale and
    offset (their [n, 2] qparams), bounded with one reduction instead of two."""
    if scale.numel() == 0:
        return True
    # First one bound for all rows (max |qparam| * (qmax + 1)), one or two reductions:
    # the per-row bound below costs several times as much, in calls the restore's decode
    # threads hand the GIL over for, and is needed only for rows near the limit (or NaN).
    parts = (scale, offset) if both is None else (both,)
    ends = [abs(float(v)) for t in parts for v in torch.aminmax(t)]
    if max(ends) * (qmax + 1) <= limit * (1 - 2.0**-20) and not any(map(math.isnan, ends)):
        return True
    bound = offset.double().abs() + scale.double().abs() * qmax
    return bool((bound <= limit * (1 - 2.0**-20)).all())

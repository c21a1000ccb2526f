"""fp16 per-row quantization parameters and the code arithmetic shared by encode and search.

The encoder, the decoder and the range search must compute exactly the same numbers, on
CPU and CUDA alike, so the arithmetic lives here once, as separate IEEE float32 ops (one op
per kernel, so no fused multiply-add can make the devices disagree).
"""

from __future__ import annotations

import torch

__all__ = ["FP16_MAX", "fp16_qparams", "quantize_codes", "round_codes_", "dequantize"]

FP16_MAX = 65504.0


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


def dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Codes (any int or float dtype) [n, w] -> float32 offset + q * scale.

    Clamped to the fp16 range: the top code of a row whose range was clamped can land
    above FP16_MAX, which an fp16 table would turn into inf.
    """
    y = q.to(torch.float32) * scale
    y += offset
    return y.clamp_(-FP16_MAX, FP16_MAX)

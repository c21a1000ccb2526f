"""Choice of the quantization range [lo, hi] of each row: min/max or adaptive clipping.

Check-N-Run's adaptive quantization clips each row's range where that lowers the row's L2
error: a few outliers otherwise stretch the scale for every other element. The search is
PyTorch's `choose_qparams_optimized` (aten/src/ATen/native/quantized/QTensor.cpp), run for
all rows at once as tensor ops so it stays on the rows' device:

    step = (max - min) / N_BINS; walk from [min, max], each time moving the end whose move
    gives the lower error, for N_BINS * MAX_CLIP_RATIO steps (so at most that fraction of
    the range is clipped); the answer is the best local optimum met (min/max itself
    counts), or the end of the walk if that is better still (an addition to the reference).

Then the winner and plain min/max are both encoded exactly as the encoder will (fp16
parameters, codes, output dtype) and the winner is kept only if its float64 L2 error is
strictly lower, so the adaptive range is never worse than min/max.
"""

from __future__ import annotations

import torch

from cnrstore.qparams import (
    FP16_MAX,
    FP32_MAX,
    dequantize,
    fp16_qparams,
    fp32_qparams,
    quantize_codes,
    round_codes_,
)

__all__ = ["SEARCHES", "N_BINS", "MAX_CLIP_RATIO", "choose_ranges", "row_sq_errors"]

SEARCHES = ("greedy", "minmax")
N_BINS = 200
MAX_CLIP_RATIO = 0.16
_STEPS = round(N_BINS * MAX_CLIP_RATIO)
# The adaptive range must beat min/max by this relative margin, so that a caller summing
# the same errors in another order still sees it as no worse.
_WIN_MARGIN = 1e-9
# Elements per search chunk. CPU: below torch's intra-op grain size (32768), so every op
# runs on the calling thread; forking OpenMP threads per op on cache-sized chunks costs
# 10-100x when the cores are shared (measured, docs/QUANTIZATION.md). CUDA: bounds memory.
_CPU_CHUNK_ELEMS = (1 << 15) - 1
_CUDA_CHUNK_ELEMS = 1 << 24


def choose_ranges(
    x: torch.Tensor, bits: int, *, search: str, dtype: torch.dtype, wide: bool = False
):
    """float32 rows [n, w] -> (lo, hi), float32 [n] each: the range to quantize per row.

    `dtype` is the table's dtype, which the final comparison decodes to; `wide` says the
    rows get fp32 qparams (docs/QUANTIZATION.md, "Wide rows").
    """
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    n, w = x.shape
    if w == 0 or n == 0:
        zeros = torch.zeros(n, dtype=torch.float32, device=x.device)
        return zeros, zeros.clone()
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    if search == "minmax":
        return lo, hi
    out_lo, out_hi = lo.clone(), hi.clone()
    budget = _CUDA_CHUNK_ELEMS if x.device.type == "cuda" else _CPU_CHUNK_ELEMS
    rows = max(1, budget // w)
    for start in range(0, n, rows):
        sl = slice(start, start + rows)
        glo, ghi = _greedy(x[sl], lo[sl], hi[sl], bits)
        err_mm = row_sq_errors(x[sl], lo[sl], hi[sl], bits, dtype, wide=wide)
        err_g = row_sq_errors(x[sl], glo, ghi, bits, dtype, wide=wide)
        win = err_g < err_mm * (1 - _WIN_MARGIN)
        out_lo[sl] = torch.where(win, glo, lo[sl])
        out_hi[sl] = torch.where(win, ghi, hi[sl])
    return out_lo, out_hi


def row_sq_errors(x, lo, hi, bits: int, dtype: torch.dtype, *, wide: bool = False
                  ) -> torch.Tensor:
    """float64 [n]: sum of squared errors of each row encoded with range [lo, hi] and
    decoded to `dtype`, computed exactly as encode_rows/decode_rows do."""
    qparams = fp32_qparams if wide else fp16_qparams
    scale, offset = qparams(lo, hi, bits)
    limit = FP32_MAX if wide else FP16_MAX
    rec = dequantize(quantize_codes(x, scale, offset, bits), scale, offset, limit=limit)
    rec = rec.to(dtype)
    diff = rec.to(torch.float64) - x.to(torch.float64)
    return (diff * diff).sum(dim=1)


def _residual_norm(y: torch.Tensor, levels: int, q: torch.Tensor) -> torch.Tensor:
    """Per-row L2 norm of (clamp(round(y), 0, levels) - y): the fake-quantization error
    of rows already scaled to code units."""
    round_codes_(y, levels, out=q)
    q -= y
    return torch.linalg.vector_norm(q, dim=1)


def _loss(x, lo, hi, levels: int, y, q) -> torch.Tensor:
    """L2 error of fake-quantizing rows x with float32 range [lo, hi] ([n] each), as
    choose_qparams_optimized computes it; y, q are [n, w] work buffers."""
    scale = (hi - lo) / levels
    inv = torch.where(scale > 0, 1.0 / scale, torch.ones_like(scale))
    torch.sub(x, lo[:, None], out=y)
    y *= inv[:, None]
    return _residual_norm(y, levels, q) * scale


def _greedy(x, lo, hi, bits: int):
    levels = (1 << bits) - 1
    y = torch.empty_like(x)
    q = torch.empty_like(x)
    step = (hi - lo) / N_BINS
    loss = _loss(x, lo, hi, levels, y, q)
    best_lo, best_hi, best_loss = lo, hi, loss
    tiny = torch.finfo(torch.float32).tiny
    # The reference walks while more than (1 - MAX_CLIP_RATIO) of the range is left, i.e.
    # N_BINS * MAX_CLIP_RATIO steps in exact arithmetic; a fixed count gives every row the
    # same walk (float rounding cannot add or drop a step) and needs no device syncs.
    for _ in range(_STEPS):
        up = lo + step
        down = hi - step
        # Both moves leave the same scale; they differ only by an offset of one step,
        # which in code units is the per-row constant step / scale: y_up = y_down - that.
        scale = (down - lo) / levels
        inv = scale.clamp_min(tiny).reciprocal_()  # a constant row has y = 0 anyway
        torch.sub(x, lo[:, None], out=y)
        y *= inv[:, None]
        loss_down = _residual_norm(y, levels, q) * scale
        y -= (step * inv)[:, None]
        loss_up = _residual_norm(y, levels, q) * scale
        better = torch.minimum(loss_up, loss_down)
        # A local optimum better than any met so far (min/max is the first candidate).
        local = loss < torch.minimum(better, best_loss)
        best_lo = torch.where(local, lo, best_lo)
        best_hi = torch.where(local, hi, best_hi)
        best_loss = torch.where(local, loss, best_loss)
        move_up = loss_up < loss_down
        lo = torch.where(move_up, up, lo)
        hi = torch.where(move_up, hi, down)
        loss = better
    # Unlike the reference, the end of the walk is a candidate too: at 2-3 bits the loss
    # often falls all the way to the clipping limit, which no local optimum records.
    end = loss < best_loss
    return torch.where(end, lo, best_lo), torch.where(end, hi, best_hi)

"""The "grid" range search: a grid of clipped ranges, then least-squares refinement.

Check-N-Run's greedy walk (qsearch.py) evaluates 65 ranges per row, one after the other.
This search reaches an equal or lower error in total with a third of the work:

1. **Grid.** With step = (max - min) / 200 as in the walk, evaluate every range
   [min + a * step, max - b * step] with a, b multiples of ``GRID`` and a + b <= ``CLIP``
   steps (21 ranges: the walk's own region, at most 15% of the range clipped), min/max
   included, and keep the one of lowest L2 error.
2. **Least squares.** For the codes that range gives, the scale and offset of lowest L2
   error are a linear regression of the row on its codes; re-quantizing with them can only
   keep or lower the error (each half-step minimizes the same error over one variable),
   so a few rounds polish the grid's winner off the grid (the range may also widen).

The caller then encodes the result and min/max exactly as the encoder will and keeps the
result only where its error is lower (qsearch.choose_ranges), so **the search is never
worse than min/max per row**, whatever these float32 losses say. Against the walk, per
row it may be slightly better or worse; in total it is lower at 2, 3 and 4 bits on every
row distribution measured (docs/QUANTIZATION.md, "Grid search").

Both implementations below (numpy for CPU, torch for CUDA) compute the same candidates;
their float sums round in different orders, so on near-ties they may pick different ranges
of (nearly) the same error.
"""

from __future__ import annotations

import numpy as np
import torch

from cnrstore.codec.qparams import fp16_qparams, within_limit

__all__ = ["GRID", "CLIP", "LSQ_ROUNDS", "WIN_MARGIN", "grid_numpy", "grid_torch", "grid_task",
           "sq_errors_numpy"]

N_BINS = 200
GRID = 6          # grid spacing, in steps of (max - min) / N_BINS
CLIP = 30         # most steps clipped (a + b), as the walk's 32 at most
LSQ_ROUNDS = 4
# A searched range must beat min/max by this relative margin, so that a caller summing the
# same errors in another order still sees it as no worse.
WIN_MARGIN = 1e-9
_FP16_MAX = np.float32(65504.0)
_TINY = np.float32(np.finfo(np.float32).tiny)
_PAIRS = [(a, k - a) for k in range(0, CLIP + 1, GRID) for a in range(0, k + 1, GRID)]
_PAIR_A = np.array([a for a, _ in _PAIRS], dtype=np.float32)
_PAIR_B = np.array([b for _, b in _PAIRS], dtype=np.float32)


def grid_numpy(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [m, w] -> (lo, hi) float32 [m] each. Non-finite rows get garbage (the
    caller's exact comparison gives them min/max)."""
    levels = np.float32((1 << bits) - 1)
    xt = np.ascontiguousarray(x.T)  # rows along the contiguous axis: per-row ops vectorize
    w, m = xt.shape
    y = np.empty_like(xt)
    q = np.empty_like(xt)
    with np.errstate(all="ignore"):
        lo0, hi0 = xt.min(axis=0), xt.max(axis=0)
        step = (hi0 - lo0) / np.float32(N_BINS)
        # One row of losses per candidate, chosen at the end: per candidate only its five
        # passes over the rows, no per-row bookkeeping ops (a third of the search's calls).
        losses = np.empty((len(_PAIRS), m), dtype=np.float32)
        j = 0
        for k in range(0, CLIP + 1, GRID):  # ranges of one width share their scale
            scale = (hi0 - lo0 - np.float32(k) * step) / levels
            inv = np.float32(1) / np.maximum(scale, _TINY)
            np.subtract(xt, lo0, out=y)
            y *= inv
            shift = np.float32(GRID) * step * inv
            first = j
            for a in range(0, k + 1, GRID):
                if a:
                    y -= shift
                np.rint(y, out=q)
                np.clip(q, 0, levels, out=q)
                q -= y
                np.einsum("ij,ij->j", q, q, out=losses[j])
                j += 1
            losses[first:j] *= scale * scale
        # The first candidate of lowest loss (in _PAIRS order); a NaN loss never wins.
        np.copyto(losses, np.float32(np.inf), where=np.isnan(losses))
        pick = losses.argmin(axis=0)
        found = np.isfinite(losses[pick, np.arange(m)])  # else min/max, as it started
        lo = np.where(found, lo0 + _PAIR_A[pick] * step, lo0)
        hi = np.where(found, hi0 - _PAIR_B[pick] * step, hi0)
        n = np.float32(w)
        mean_x = xt.sum(axis=0) / n
        xc = xt - mean_x  # centred rows: the regression's sums stay well-conditioned
        for _ in range(LSQ_ROUNDS):
            scale = (hi - lo) / levels
            inv = np.float32(1) / np.maximum(scale, _TINY)
            np.subtract(xt, lo, out=y)
            y *= inv
            np.rint(y, out=y)
            np.clip(y, 0, levels, out=y)
            mean_q = y.sum(axis=0) / n
            y -= mean_q
            sqq = np.einsum("ij,ij->j", y, y)
            sxq = np.einsum("ij,ij->j", y, xc)
            ok = (sqq > 0) & (sxq > 0) & np.isfinite(sxq)
            b = sxq / np.where(ok, sqq, np.float32(1))
            a = mean_x - b * mean_q
            lo = np.where(ok, a, lo).astype(np.float32)
            hi = np.where(ok, a + levels * b, hi).astype(np.float32)
    return lo, hi


def grid_torch(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """grid_numpy's search as torch ops on x's device: float32 rows [m, w] -> (lo, hi)."""
    levels = float((1 << bits) - 1)
    lo0, hi0 = x.amin(dim=1), x.amax(dim=1)
    step = (hi0 - lo0) / N_BINS
    tiny = torch.finfo(torch.float32).tiny
    best = torch.full_like(lo0, torch.inf)
    blo, bhi = lo0.clone(), hi0.clone()
    y = torch.empty_like(x)
    q = torch.empty_like(x)
    for a, b in _PAIRS:
        scale = (hi0 - lo0 - (a + b) * step) / levels
        inv = scale.clamp_min(tiny).reciprocal()
        lo = lo0 + a * step
        torch.sub(x, lo[:, None], out=y)
        y *= inv[:, None]
        torch.round(y, out=q)
        q.clamp_(0, levels)
        q -= y
        loss = (q * q).sum(dim=1) * scale * scale
        better = loss < best
        best = torch.where(better, loss, best)
        blo = torch.where(better, lo, blo)
        bhi = torch.where(better, hi0 - b * step, bhi)
    lo, hi = blo, bhi
    mean_x = x.mean(dim=1)
    xc = x - mean_x[:, None]
    for _ in range(LSQ_ROUNDS):
        scale = (hi - lo) / levels
        inv = scale.clamp_min(tiny).reciprocal()
        torch.sub(x, lo[:, None], out=y)
        y *= inv[:, None]
        torch.round(y, out=y)
        y.clamp_(0, levels)
        mean_q = y.mean(dim=1)
        y -= mean_q[:, None]
        sqq = (y * y).sum(dim=1)
        sxq = (y * xc).sum(dim=1)
        ok = (sqq > 0) & (sxq > 0) & torch.isfinite(sxq)
        slope = sxq / torch.where(ok, sqq, torch.ones_like(sqq))
        base = mean_x - slope * mean_q
        lo = torch.where(ok, base, lo)
        hi = torch.where(ok, base + levels * slope, hi)
    return lo, hi


def grid_task(x: np.ndarray, bits: int, dtype: torch.dtype, walk: int):
    """Grid ranges of contiguous float32 rows [n, w], kept where the encoder's error with
    them is below min/max's by WIN_MARGIN, so the error never exceeds min/max's whatever
    the order of summation. The errors are first summed in float32 with a proven bound
    (``_F32_REL``); only rows the bound cannot decide are summed again in float64."""
    n, w = x.shape
    out_lo, out_hi = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)
    # float32 error sums: each difference rounds once (2^-24), its square once more, and a
    # sum of w non-negative terms is within w ulps of exact in any order; squares under
    # float32's normal range are absolute errors of at most 2^-126 each.
    rel = np.float32((w + 8) * 2.0**-24)
    absolute = np.float32(w * 2.0**-126)
    keep = np.float32(1 - WIN_MARGIN)
    for s in range(0, n, walk):
        part = x[s : s + walk]
        glo, ghi = grid_numpy(part, bits)
        lo, hi = part.min(axis=1), part.max(axis=1)
        mm_q, g_q = _qparams(lo, hi, bits), _qparams(glo, ghi, bits)
        with np.errstate(all="ignore"):
            e_mm = _sq32(part, _decoded(part, *mm_q, bits, dtype))
            e_g = _sq32(part, _decoded(part, *g_q, bits, dtype))
            win = (e_g * (1 + rel) + absolute) < (e_mm * (1 - rel) - absolute) * keep
            lose = (e_g * (1 - rel) - absolute) >= (e_mm * (1 + rel) + absolute) * keep
        unsure = np.flatnonzero(~(win | lose))  # NaN and inf rows too: float64 decides
        if len(unsure):
            sub = part[unsure]
            sub64 = sub.astype(np.float64)
            e64_mm = sq_errors_numpy(sub, sub64, mm_q[0][unsure], mm_q[1][unsure], bits, dtype)
            e64_g = sq_errors_numpy(sub, sub64, g_q[0][unsure], g_q[1][unsure], bits, dtype)
            with np.errstate(invalid="ignore"):
                win[unsure] = e64_g < e64_mm * (1 - WIN_MARGIN)
        out_lo[s : s + walk] = np.where(win, glo, lo)
        out_hi[s : s + walk] = np.where(win, ghi, hi)
    return torch.from_numpy(out_lo), torch.from_numpy(out_hi)


def _qparams(lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    scale, offset = fp16_qparams(torch.from_numpy(lo), torch.from_numpy(hi), bits)
    return scale.numpy(), offset.numpy()


def _sq32(x: np.ndarray, rec: np.ndarray) -> np.ndarray:
    """Row sums of (rec - x)^2 in float32; rec (_decoded's own temporary) is overwritten."""
    d = rec.astype(np.float32, copy=False)
    np.subtract(d, x, out=d)
    return np.einsum("ij,ij->i", d, d)


def _decoded(x, scale: np.ndarray, offset: np.ndarray, bits: int, dtype: torch.dtype
             ) -> np.ndarray:
    """decode(encode(x)) with fp16 qparams [m, 1], as the encoder and decoder compute it
    (quantize_codes, dequantize, the cast to dtype), in numpy."""
    with np.errstate(all="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0))
        y = x - offset
        y *= inv
        np.clip(y, 0, (1 << bits) - 1, out=y)
        np.rint(y, out=y)
        y *= scale
        y += offset
        if not within_limit(torch.from_numpy(scale), torch.from_numpy(offset),
                            (1 << bits) - 1, float(_FP16_MAX)):  # else the clamp is a no-op
            np.clip(y, -_FP16_MAX, _FP16_MAX, out=y)
        if dtype == torch.float16:
            y = y.astype(np.float16)
        elif dtype == torch.bfloat16:  # round to nearest even, as torch's conversion
            u = y.view(np.uint32)
            u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
            u &= np.uint32(0xFFFF0000)
        return y


def sq_errors_numpy(x, x64, scale: np.ndarray, offset: np.ndarray, bits: int,
                    dtype: torch.dtype) -> np.ndarray:
    """qsearch.row_sq_errors of float32 rows [m, w] with fp16 qparams (scale, offset)
    [m, 1] (x64: the rows in float64): the encoder's element operations in numpy, float64
    sums."""
    diff = _decoded(x, scale, offset, bits, dtype).astype(np.float64)
    diff -= x64
    return np.einsum("ij,ij->i", diff, diff)

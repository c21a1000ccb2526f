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

On CPU the same walk runs in numpy, on all cores, and returns the very same range per row
as the torch walk ("CPU path" below says how that is guaranteed).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from cnrstore.codec.cores import cores, thread_pool
from cnrstore.codec.qgrid import WIN_MARGIN, grid_task, grid_torch, sq_errors_numpy
from cnrstore.codec.qparams import (
    FP16_MAX,
    FP32_MAX,
    dequantize,
    fp16_qparams,
    fp32_qparams,
    quantize_codes,
    round_codes_,
)

__all__ = [
    "SEARCHES",
    "N_BINS",
    "MAX_CLIP_RATIO",
    "choose_ranges",
    "choose_row_ranges",
    "row_sq_errors",
]

SEARCHES = ("grid", "greedy", "minmax")
N_BINS = 200
MAX_CLIP_RATIO = 0.16
_STEPS = round(N_BINS * MAX_CLIP_RATIO)
_WIN_MARGIN = WIN_MARGIN  # qgrid.WIN_MARGIN: one margin for both searches
# Elements per search chunk. CPU: below torch's intra-op grain size (32768), so every op
# runs on the calling thread; forking OpenMP threads per op on cache-sized chunks costs
# 10-100x when the cores are shared (measured, docs/QUANTIZATION.md). CUDA: bounds memory.
_CPU_CHUNK_ELEMS = (1 << 15) - 1
_CUDA_CHUNK_ELEMS = 1 << 24
# CPU rows take the numpy walk (same result, faster); benches/bench_quant.py turns this off
# to time the torch walk that CPUs ran before, in the same run.
_NUMPY_CPU = True


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
    if search != "minmax" and x.device.type == "cpu" and _NUMPY_CPU and not wide:
        return _rows_cpu(x, bits, dtype, search)
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    if search == "minmax":
        return lo, hi
    out_lo, out_hi = lo.clone(), hi.clone()
    budget = _CUDA_CHUNK_ELEMS if x.device.type == "cuda" else _CPU_CHUNK_ELEMS
    rows = max(1, budget // w)
    for start in range(0, n, rows):
        sl = slice(start, start + rows)
        if search == "grid":
            glo, ghi = grid_torch(x[sl], bits)
        else:
            glo, ghi = _greedy(x[sl], lo[sl], hi[sl], bits)
        err_mm = row_sq_errors(x[sl], lo[sl], hi[sl], bits, dtype, wide=wide)
        err_g = row_sq_errors(x[sl], glo, ghi, bits, dtype, wide=wide)
        win = err_g < err_mm * (1 - _WIN_MARGIN)
        out_lo[sl] = torch.where(win, glo, lo[sl])
        out_hi[sl] = torch.where(win, ghi, hi[sl])
    return out_lo, out_hi


def choose_row_ranges(rows: torch.Tensor, bits: int, *, search: str):
    """Ranges of all `rows` ([n, w], any lossy dtype) at once, or None where the caller's
    own chunked choose_ranges is as fast (min/max, CUDA). On CPU the greedy search then
    runs its row chunks on all cores, converting each chunk to float32 itself (no float32
    copy of the whole table); the chunks and results are those of choose_ranges."""
    if search == "minmax" or rows.device.type != "cpu" or rows.numel() == 0 or not _NUMPY_CPU:
        return None
    return _rows_cpu(rows, bits, rows.dtype, search)


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


# --- CPU path ---------------------------------------------------------------------------------
#
# The torch walk above costs ~70 small ops per step; numpy runs the same float32 element
# operations (subtract, multiply, clamp, round half to even, subtract: IEEE, so bit for bit
# the torch results) with less dispatch, and its loops release the GIL, so row chunks run
# on all cores. Only the row reduction differs: torch sums the squared residuals in float32
# in its own order, numpy in another, so the two losses of a candidate can differ by the
# two summation errors (bound in _walk_numpy). A step whose two losses are closer than
# that bound could go either way in the torch walk, and a path whose minimum is not unique
# by that margin could pick either: such rows (~2% at 4 bits, ~8% at 2, more on tiny or
# symmetric rows) are re-run through the torch walk itself. Every other row took the torch
# walk's path and its minimum. The final comparison with min/max uses the same element
# operations, and torch's own float64 sums wherever numpy's could fall on the other side
# of the margin: the CPU path chooses what the torch walk chooses, row for row.

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
# Search chunks (of _CPU_CHUNK_ELEMS) per thread task: a task re-runs its unsure rows in one
# torch walk, whose cost is per op rather than per row, so tasks must be large for that to
# stay small; the numpy walk takes _WALK_CHUNKS chunks at a time, which amortizes numpy's
# per-op cost (a greedy step also runs ops on per-row vectors), and the grid walks a whole
# task at once. 16 chunks (2 MB of float32 rows at 64 wide): 210 K x 64 rows took
# 0.364 s against 0.397 s at 8 (the grid, 2 cores) and 60 K rows of the greedy walk 0.259
# against 0.298 s, the same ranges row for row (rows never interact). A put of fewer rows
# is split into at least one task per core (_task_rows).
_CHUNKS_PER_TASK = 16
_WALK_CHUNKS = 16


def _task_rows(n: int, chunk: int) -> int:
    """Rows per task: at most _CHUNKS_PER_TASK chunks, and at least one task per core
    where n allows, a whole number of chunks each."""
    tasks = max(cores(), -(-n // (chunk * _CHUNKS_PER_TASK)))
    per = -(-n // tasks)
    return -(-per // chunk) * chunk


def _reset_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has the object but not the threads


os.register_at_fork(after_in_child=_reset_pool)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = thread_pool(cores(), "cnrstore-qsearch")
        return _POOL


def _rows_cpu(rows: torch.Tensor, bits: int, dtype: torch.dtype, search: str):
    """Ranges of CPU rows of any float dtype, on all cores. Greedy: the same result as the
    torch search on choose_ranges' chunks; grid: qgrid's numpy search."""
    n, w = rows.shape
    out_lo = torch.zeros(n, dtype=torch.float32)
    out_hi = torch.zeros(n, dtype=torch.float32)
    if n == 0 or w == 0:
        return out_lo, out_hi
    chunk = max(1, _CPU_CHUNK_ELEMS // w)
    per_task = _task_rows(n, chunk)
    starts = range(0, n, per_task)

    def task(start: int) -> None:
        stop = min(n, start + per_task)
        x = torch.empty((stop - start, w), dtype=torch.float32)
        for s in range(start, stop, chunk):  # torch ops stay below the grain size
            x[s - start : s - start + chunk].copy_(rows[s : min(stop, s + chunk)])
        if search == "grid":
            lo, hi = grid_task(x.numpy(), bits, dtype, per_task)
        else:
            lo, hi = _greedy_task(x, bits, dtype, chunk)
        out_lo[start:stop] = lo
        out_hi[start:stop] = hi

    if len(starts) == 1 or cores() == 1:
        for start in starts:
            task(start)
    else:
        for f in [_pool().submit(task, s) for s in starts]:
            f.result()
    return out_lo, out_hi


def _greedy_task(xt: torch.Tensor, bits: int, dtype: torch.dtype, chunk: int):
    """choose_ranges' result for contiguous float32 CPU rows [n, w]."""
    x = xt.numpy()
    n = x.shape[0]
    glo = np.empty(n, dtype=np.float32)
    ghi = np.empty(n, dtype=np.float32)
    unsure = np.empty(n, dtype=bool)
    walk = chunk * _WALK_CHUNKS
    for s in range(0, n, walk):
        sl = slice(s, s + walk)
        glo[sl], ghi[sl], unsure[sl] = _walk_numpy(x[sl], bits)
    lo_t, hi_t = torch.from_numpy(x.min(axis=1)), torch.from_numpy(x.max(axis=1))
    glo_t, ghi_t = torch.from_numpy(glo), torch.from_numpy(ghi)
    redo = torch.from_numpy(np.flatnonzero(unsure))
    for s in range(0, redo.numel(), chunk):  # the torch walk, in chunks below the grain size
        idx = redo[s : s + chunk]
        glo_t[idx], ghi_t[idx] = _greedy(xt[idx], lo_t[idx], hi_t[idx], bits)
    # As choose_ranges: the winner against min/max, by row_sq_errors' element operations
    # in numpy; rows whose float64 sums (another order, so within 4 (w + 2) ulps of
    # torch's) are that close to the margin get torch's own sums.
    err_mm = np.empty(n)
    err_g = np.empty(n)
    for s in range(0, n, walk):
        sl = slice(s, s + walk)
        x64 = x[sl].astype(np.float64)
        err_mm[sl] = _sq_errors_numpy(x[sl], x64, lo_t[sl], hi_t[sl], bits, dtype)
        err_g[sl] = _sq_errors_numpy(x[sl], x64, glo_t[sl], ghi_t[sl], bits, dtype)
    with np.errstate(all="ignore"):
        gap = np.abs(err_g - err_mm * (1 - _WIN_MARGIN))
        close = ~(gap > 4 * (x.shape[1] + 2) * 2.0**-53 * (err_g + err_mm))
    close &= np.isfinite(err_mm)  # non-finite rows lose to min/max in either order
    err_mm_t, err_g_t = torch.from_numpy(err_mm), torch.from_numpy(err_g)
    fix = torch.from_numpy(np.flatnonzero(close))
    for s in range(0, fix.numel(), chunk):
        idx = fix[s : s + chunk]
        err_mm_t[idx] = row_sq_errors(xt[idx], lo_t[idx], hi_t[idx], bits, dtype)
        err_g_t[idx] = row_sq_errors(xt[idx], glo_t[idx], ghi_t[idx], bits, dtype)
    win = err_g_t < err_mm_t * (1 - _WIN_MARGIN)
    return torch.where(win, glo_t, lo_t), torch.where(win, ghi_t, hi_t)


def _sq_errors_numpy(x, x64, lo_t, hi_t, bits: int, dtype: torch.dtype) -> np.ndarray:
    """row_sq_errors of float32 rows [m, w] (x64: the same in float64), the same element
    operations (quantize_codes, dequantize, the cast to dtype) in numpy."""
    scale, offset = (t.numpy() for t in fp16_qparams(lo_t, hi_t, bits))
    return sq_errors_numpy(x, x64, scale, offset, bits, dtype)


def _row_sq_sums(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b)


# numpy >= 2.0's vecdot is a ufunc, ~15% cheaper than einsum on these rows.
_row_sq_sums = getattr(np, "vecdot", None) or _row_sq_sums  # noqa: F811


def _walk_numpy(x: np.ndarray, bits: int):
    """_greedy's walk over float32 rows [m, w] -> (lo, hi, unsure) [m] each: the torch
    walk's pick wherever `unsure` is False."""
    m, w = x.shape
    levels = np.float32((1 << bits) - 1)
    # Rows along the contiguous axis: per-row broadcasts then run as plain vector loops
    # (~25% cheaper than broadcasting along rows), and the row sums vectorize across rows.
    x = np.ascontiguousarray(x.T)
    with np.errstate(all="ignore"):  # non-finite rows compute garbage, then get min/max
        lo, hi = x.min(axis=0), x.max(axis=0)
        step = (hi - lo) / np.float32(N_BINS)
        losses = np.empty((_STEPS + 1, m), dtype=np.float32)
        loss_up = np.empty((_STEPS, m), dtype=np.float32)
        loss_down = np.empty((_STEPS, m), dtype=np.float32)
        los = np.empty((_STEPS + 1, m), dtype=np.float32)
        his = np.empty((_STEPS + 1, m), dtype=np.float32)
        y = np.empty_like(x)
        q = np.empty_like(x)

        def loss(scale, out, q=q):  # _residual_norm(y) * scale, summed in another order
            np.clip(y, 0, levels, out=q)
            np.rint(q, out=q)
            q -= y
            np.multiply(np.sqrt(np.einsum("ij,ij->j", q, q)), scale, out=out)

        scale = (hi - lo) / levels
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(1)).astype(np.float32)
        np.subtract(x, lo, out=y)
        y *= inv
        loss(scale, losses[0])
        los[0], his[0] = lo, hi
        # Bound on |numpy loss - torch loss| relative to the loss: a float32 sum of w
        # products is within w ulps of the exact sum (any order), so sqrt(sum) * scale is
        # within w / 2 + 2 ulps of the exact loss, in either implementation: w + 4 apart
        # at most (w + 6 here); plus an absolute part for squares that underflow, scaled
        # by the largest scale.
        rel = np.float32((w + 6) * 2.0**-24)
        absolute = np.float32(np.sqrt((w + 1) * 2.0**-125)) * scale
        tiny = np.float32(np.finfo(np.float32).tiny)
        for t in range(_STEPS):
            up = lo + step
            down = hi - step
            scale = (down - lo) / levels
            inv = np.float32(1) / np.maximum(scale, tiny)
            np.subtract(x, lo, out=y)
            y *= inv
            loss(scale, loss_down[t])
            y -= step * inv
            loss(scale, loss_up[t])
            move_up = loss_up[t] < loss_down[t]
            lo = np.where(move_up, up, lo)
            hi = np.where(move_up, hi, down)
            los[t + 1], his[t + 1] = lo, hi
        np.minimum(loss_up, loss_down, out=losses[1:])
        # A decision is sure when the two losses differ by more than both bounds.
        margin = rel * (loss_up + loss_down) + 2 * absolute
        unsure = ~np.all(np.abs(loss_up - loss_down) > margin, axis=0)  # NaN: unsure
        # The torch walk picks the path's minimum (first local optimum reaching it, or the
        # end): the same one here unless another loss is within the bounds of it.
        best = np.argmin(losses, axis=0)
        err = rel * losses + absolute
        floor = np.min(losses + err, axis=0)
        unsure |= np.count_nonzero(losses - err <= floor, axis=0) != 1
        # Constant rows (or ranges under 200 subnormals) have one candidate, min/max;
        # non-finite rows get min/max in the final comparison whatever is picked here.
        unsure &= np.isfinite(los[0]) & np.isfinite(his[0]) & (step > 0)
        cols = np.arange(m)
        return los[best, cols], his[best, cols], unsure

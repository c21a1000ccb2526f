"""The CPU (numpy) greedy range search against the torch walk it replaces on CPU.

`_reference_choose_ranges` below is cnrstore/codec/qsearch.py's search as it was before the numpy
path (the torch walk, run on choose_ranges' chunks), kept here verbatim as the reference:
the numpy path must choose the very same range for every row, hence the same error, which
is never worse than min/max.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.codec import qsearch
from cnrstore.codec.qparams import round_codes_
from cnrstore.codec.qsearch import MAX_CLIP_RATIO, N_BINS, choose_ranges, row_sq_errors
from cnrstore.codec.quantize import LOSSY_DTYPES, decode_rows, encode_rows

BITS = (2, 3, 4, 8)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --- the reference: the torch walk as it was ----------------------------------------------

_STEPS = round(N_BINS * MAX_CLIP_RATIO)


def _residual_norm(y, levels, q):
    round_codes_(y, levels, out=q)
    q -= y
    return torch.linalg.vector_norm(q, dim=1)


def _loss(x, lo, hi, levels, y, q):
    scale = (hi - lo) / levels
    inv = torch.where(scale > 0, 1.0 / scale, torch.ones_like(scale))
    torch.sub(x, lo[:, None], out=y)
    y *= inv[:, None]
    return _residual_norm(y, levels, q) * scale


def _reference_greedy(x, lo, hi, bits):
    levels = (1 << bits) - 1
    y = torch.empty_like(x)
    q = torch.empty_like(x)
    step = (hi - lo) / N_BINS
    loss = _loss(x, lo, hi, levels, y, q)
    best_lo, best_hi, best_loss = lo, hi, loss
    tiny = torch.finfo(torch.float32).tiny
    for _ in range(_STEPS):
        up = lo + step
        down = hi - step
        scale = (down - lo) / levels
        inv = scale.clamp_min(tiny).reciprocal_()
        torch.sub(x, lo[:, None], out=y)
        y *= inv[:, None]
        loss_down = _residual_norm(y, levels, q) * scale
        y -= (step * inv)[:, None]
        loss_up = _residual_norm(y, levels, q) * scale
        better = torch.minimum(loss_up, loss_down)
        local = loss < torch.minimum(better, best_loss)
        best_lo = torch.where(local, lo, best_lo)
        best_hi = torch.where(local, hi, best_hi)
        best_loss = torch.where(local, loss, best_loss)
        move_up = loss_up < loss_down
        lo = torch.where(move_up, up, lo)
        hi = torch.where(move_up, hi, down)
        loss = better
    end = loss < best_loss
    return torch.where(end, lo, best_lo), torch.where(end, hi, best_hi)


def _reference_choose_ranges(x, bits, dtype):
    n, w = x.shape
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    out_lo, out_hi = lo.clone(), hi.clone()
    rows = max(1, ((1 << 15) - 1) // w)
    for start in range(0, n, rows):
        sl = slice(start, start + rows)
        glo, ghi = _reference_greedy(x[sl], lo[sl], hi[sl], bits)
        err_mm = row_sq_errors(x[sl], lo[sl], hi[sl], bits, dtype)
        err_g = row_sq_errors(x[sl], glo, ghi, bits, dtype)
        win = err_g < err_mm * (1 - 1e-9)
        out_lo[sl] = torch.where(win, glo, lo[sl])
        out_hi[sl] = torch.where(win, ghi, hi[sl])
    return out_lo, out_hi


# --- rows --------------------------------------------------------------------------------

KINDS = ("normal", "outliers", "constant", "integers", "symmetric", "uniform")


def _rows(kind, n, width, seed, spread, offset):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=gen, dtype=torch.float64)
    if kind == "outliers":
        mask = torch.rand(n, width, generator=gen) < 0.05
        x = torch.where(mask, x * 50, x)
    elif kind == "constant":
        x = x[:, :1].expand(n, width).clone()
    elif kind == "integers":  # many exact ties between the two moves
        x = torch.randint(-3, 4, (n, width), generator=gen).double()
    elif kind == "symmetric":  # the two moves mirror each other
        half = x[:, : (width + 1) // 2]
        x = torch.cat([half, -half.flip(1)], dim=1)[:, :width]
    elif kind == "uniform":
        x = torch.rand(n, width, generator=gen, dtype=torch.float64)
    return x * spread + offset


def _errors(x, lo, hi, bits, dtype):
    return row_sq_errors(x, lo, hi, bits, dtype)


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    bits=st.sampled_from(BITS),
    dtype=st.sampled_from(LOSSY_DTYPES),
    n=st.integers(1, 40),
    width=st.integers(1, 80),
    seed=st.integers(0, 2**31),
    spread=st.sampled_from([1e-6, 0.01, 1.0, 300.0]),
    offset=st.sampled_from([0.0, 1.0, -1000.0]),
)
def test_numpy_search_picks_the_torch_walks_range(kind, bits, dtype, n, width, seed, spread,
                                                  offset):
    x = _rows(kind, n, width, seed, spread, offset).to(dtype).float()
    lo, hi = choose_ranges(x, bits, search="greedy", dtype=dtype)
    ref_lo, ref_hi = _reference_choose_ranges(x, bits, dtype)
    err = _errors(x, lo, hi, bits, dtype)
    assert torch.all(err <= _errors(x, ref_lo, ref_hi, bits, dtype))
    assert torch.all(err <= _errors(x, x.amin(1), x.amax(1), bits, dtype))
    # Stronger than "no worse": the same range, row for row.
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)


@pytest.mark.parametrize("bits", BITS)
def test_many_rows_on_all_cores_match_the_reference(bits, monkeypatch):
    # Small tasks, so that 3000 rows make many tasks, chunks and a partial last one.
    monkeypatch.setattr(qsearch, "_CHUNKS_PER_TASK", 2)
    monkeypatch.setattr(qsearch, "_WALK_CHUNKS", 1)
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(3001, 64, generator=gen)
    x[::7, 3] *= 30  # outliers that greedy clips
    x[::11] = 0.25  # constant rows
    x[5::13, :2] = torch.tensor([1.0, -1.0])
    lo, hi = choose_ranges(x, bits, search="greedy", dtype=torch.float32)
    ref_lo, ref_hi = _reference_choose_ranges(x, bits, torch.float32)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)


@pytest.mark.parametrize("scheme", ["int4", "int3", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_rows_error_equals_the_reference_search(scheme, dtype, monkeypatch):
    # End to end through encode_rows, which runs the search once over all rows.
    monkeypatch.setattr(qsearch, "_CHUNKS_PER_TASK", 1)
    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(1500, 37, generator=gen) * torch.rand(1500, 1, generator=gen)).to(dtype)
    bits = int(scheme[3:])
    back = decode_rows(encode_rows(rows, scheme, search="greedy"), scheme, dtype, 37)
    err = ((back.double() - rows.double()) ** 2).sum(1)
    x = rows.float()
    ref_lo, ref_hi = _reference_choose_ranges(x, bits, dtype)
    assert torch.equal(err, _errors(x, ref_lo, ref_hi, bits, dtype))
    back_mm = decode_rows(encode_rows(rows, scheme, search="minmax"), scheme, dtype, 37)
    assert torch.all(err <= ((back_mm.double() - rows.double()) ** 2).sum(1))


def test_unsure_rows_are_few_on_random_rows():
    assert qsearch._walk_numpy(np.zeros((3, 5), dtype=np.float32), 4)[2].tolist() == [0, 0, 0]
    # The re-run through the torch walk is what keeps results identical; it must stay rare
    # or the numpy path loses its speed (measured: ~2% at 4 bits, ~8% at 2 bits).
    x = np.random.default_rng(0).standard_normal((4000, 64), dtype=np.float32)
    for bits, limit in ((4, 0.04), (2, 0.15)):
        assert qsearch._walk_numpy(x, bits)[2].mean() < limit


def test_non_finite_rows_get_min_max_and_encode_still_names_them():
    x = torch.randn(6, 8)
    x[1, 2] = float("nan")
    x[4, 0] = float("inf")
    x[5] = torch.tensor([3e38, -3e38] * 4)  # finite, but the range overflows float32
    lo, hi = choose_ranges(x, 4, search="greedy", dtype=torch.float32)
    ref_lo, ref_hi = _reference_choose_ranges(x, 4, torch.float32)
    assert torch.allclose(lo, ref_lo, equal_nan=True)
    assert torch.allclose(hi, ref_hi, equal_nan=True)
    with pytest.raises(ValueError, match="row 1 "):
        encode_rows(x, "int4")


def test_torch_path_still_serves_cpu_when_numpy_is_off(monkeypatch):
    monkeypatch.setattr(qsearch, "_NUMPY_CPU", False)
    x = torch.randn(700, 9, generator=torch.Generator().manual_seed(4))
    lo, hi = choose_ranges(x, 3, search="greedy", dtype=torch.float32)
    ref_lo, ref_hi = _reference_choose_ranges(x, 3, torch.float32)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)


_FORK_SCRIPT = """
import multiprocessing, sys, torch
torch.set_num_threads(1)  # torch's own OpenMP pool does not survive fork either
from cnrstore.codec import qsearch
from cnrstore.codec.quantize import encode_rows
qsearch._CHUNKS_PER_TASK = 1  # several tasks, so the thread pool is used
rows = torch.randn(4000, 16, generator=torch.Generator().manual_seed(5))

def child(queue):
    queue.put(encode_rows(rows, "int4").sum().item())

expected = encode_rows(rows, "int4").sum().item()  # the parent starts the pool
assert qsearch._POOL is not None
ctx = multiprocessing.get_context("fork")
queue = ctx.Queue()
proc = ctx.Process(target=child, args=(queue,))
proc.start()
proc.join(30)
assert proc.exitcode == 0, proc.exitcode
assert queue.get(timeout=5) == expected
"""


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_search_works_in_a_forked_child_after_the_parent_used_the_pool():
    # A forked child inherits the pool object but none of its threads: it must make its own
    # (else its tasks wait forever on threads that do not exist).
    proc = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("bits", BITS)
def test_cuda_search_matches_the_reference_on_cuda(bits):
    # CUDA keeps the torch walk: the same code as the reference, on the device.
    x = torch.randn(2000, 37, generator=torch.Generator().manual_seed(bits)).cuda()
    lo, hi = choose_ranges(x, bits, search="greedy", dtype=torch.float32)
    ref_lo, ref_hi = _reference_choose_ranges(x, bits, torch.float32)
    assert torch.equal(lo, ref_lo) and torch.equal(hi, ref_hi)

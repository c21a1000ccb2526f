"""The stall's one-pass kernels against the code they replace, on both CPU paths: the
fingerprints-with-diff (codec/fpdiff.py) against row_fingerprints and a compare, the
touched rows' diff (fpdiff.touched_changes) against their fingerprints and a compare, and a
non-blocking put's copy of its changed rows with their checks (core/hostcodes.py
copy_checked) against index_select and amin/amax."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from ckpt_util import on_kernel_path
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.codec import fingerprint as fp_mod
from cnrstore.codec import fpdiff, native
from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.codec.fpdiff import fingerprints_and_changes, touched_changes
from cnrstore.codec.qparams import fits_fp16
from cnrstore.core import hostcodes


@pytest.fixture(autouse=True, scope="module", params=["native", "fallback"])
def kernel_path(request):
    yield from on_kernel_path(request.param, fallback="fallback")


def _reference(x, old):
    fp = row_fingerprints(x)
    common = min(len(x), len(old))
    return fp, torch.nonzero(fp[:common] != old[:common]).flatten().numpy()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 70), old_rows=st.integers(0, 80), width=st.integers(0, 13),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.int8, torch.float64]),
       parts=st.sampled_from([1, 3]), seed=st.integers(0, 2**31 - 1),
       strided=st.booleans())
def test_fingerprints_and_changes_match_fingerprints_and_a_compare(
        rows, old_rows, width, dtype, parts, seed, strided):
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows, width + 3, generator=g) * 100).to(dtype)
    x = full[:, 1:width + 1] if strided else full[:, :width].contiguous()
    base = row_fingerprints(x)
    old = torch.randint(-2**62, 2**62, (old_rows,), generator=g)
    n = min(rows, old_rows)
    keep = torch.rand(n, generator=g) < 0.6
    old[:n][keep] = base[:n][keep]  # most rows unchanged, some changed
    with _parts(parts):
        fp, changed = fingerprints_and_changes(x, old)
    ref_fp, ref_changed = _reference(x, old)
    assert torch.equal(fp, ref_fp)
    assert changed.dtype == np.int64 and np.array_equal(changed, ref_changed)


@contextlib.contextmanager
def _patched(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


@contextlib.contextmanager
def _split(module, threshold, parts):
    """Work of any size in ``parts`` parts on the pool (1: the default split), where
    ``module.threshold`` is the size from which the work is split."""
    saved = getattr(module, threshold), fp_mod._cores
    if parts > 1:
        setattr(module, threshold, 0)
        fp_mod._cores = lambda: parts  # type: ignore[assignment]
    try:
        yield
    finally:
        setattr(module, threshold, saved[0])
        fp_mod._cores = saved[1]  # type: ignore[assignment]


def _parts(parts):
    """Hash tables of any size in ``parts`` parts."""
    return _split(fp_mod, "_SPLIT_MIN_BYTES", parts)


def test_a_large_table_is_diffed_in_parts_on_the_pool():
    x = torch.randn(200_000, 24)  # 19 MB: past the split threshold
    old = row_fingerprints(x)
    hot = torch.tensor([0, 1, 99_999, 100_000, 150_001, 199_999])
    x[hot] += 1
    fp, changed = fingerprints_and_changes(x, old)
    assert torch.equal(fp, row_fingerprints(x))
    assert changed.tolist() == hot.tolist()


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 70), width=st.integers(0, 700),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.int8, torch.float64]),
       parts=st.sampled_from([1, 3]), seed=st.integers(0, 2**31 - 1),
       strided=st.booleans(), data=st.data())
def test_touched_changes_match_the_touched_rows_fingerprints_and_a_compare(
        rows, width, dtype, parts, seed, strided, data):
    """Widths up to 700 float64 (5.6 KB rows) take the kernel's long-row loop as well."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows, width + 3, generator=g) * 100).to(dtype)
    x = full[:, 1:width + 1] if strided else full[:, :width].contiguous()
    t = torch.tensor(sorted(data.draw(st.sets(st.integers(0, rows - 1)))), dtype=torch.int64)
    now = row_fingerprints(x)
    fp = torch.randint(-2**62, 2**62, (rows,), generator=g)
    keep = torch.rand(rows, generator=g) < 0.5
    fp[keep] = now[keep]  # some touched rows hold what they held
    want_fp = fp.clone()
    want_fp[t] = now[t]  # the untouched rows' entries stay as they were, right or not
    want = [int(r) for r in t if not keep[r]]
    with _split(fpdiff, "_SPLIT_TOUCHED_BYTES", parts):
        changed = touched_changes(x, t, fp)
    assert changed.dtype == np.int64 and changed.tolist() == want
    assert torch.equal(fp, want_fp)


def test_touched_changes_of_many_rows_run_in_parts_on_the_pool():
    x = torch.randn(300_000, 24)
    fp = row_fingerprints(x)
    t = torch.arange(0, 300_000, 2)  # 14 MB of touched rows: past the split threshold
    hot = torch.tensor([0, 2, 149_998, 150_000, 299_998])
    x[hot] += 1
    x[1] += 1  # not touched: not seen
    threads = set()
    part = fpdiff.fpm.in_parts

    def seen(rows, parts, fn):
        return part(rows, parts, lambda lo, hi: threads.add(threading.get_ident()) or fn(lo, hi))

    with _split(fp_mod, "_SPLIT_MIN_BYTES", 2), _patched(fpdiff.fpm, "in_parts", seen):
        changed = touched_changes(x, t, fp)
    assert len(threads) == 2
    assert changed.tolist() == hot.tolist()
    want = row_fingerprints(x)
    assert torch.equal(fp[t], want[t]) and fp[1] != want[1]


_SPECIAL = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 65504.0, -65504.0,
            65505.0, -65520.0, 1e38, -3e38, 1e-45, 7.0]


@settings(max_examples=60, deadline=None)
@given(n_rows=st.integers(1, 40), width=st.integers(1, 21), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6),
                                   st.sampled_from(_SPECIAL)), max_size=8),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       strided=st.booleans(), parts=st.sampled_from([1, 2, 3]))
def test_the_copy_of_changed_rows_matches_index_select_and_amin_amax(
        n_rows, width, seed, specials, dtype, strided, parts):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(n_rows, width + 2, generator=g) * 10
    for r, c, v in specials:
        full[r % n_rows, c % (width + 2)] = v
    full = full.to(dtype)
    x = full[:, 1:width + 1] if strided else full[:, :width].contiguous()
    idx = np.sort(np.random.default_rng(seed).choice(n_rows, max(1, n_rows // 2),
                                                      replace=False)).astype(np.int64)
    rows = torch.empty(len(idx), width, dtype=dtype)
    with _copy_parts(parts):
        finite, fits = hostcodes.copy_checked(x, idx, rows)
    want = x[torch.from_numpy(idx)]
    assert torch.equal(rows.view(torch.uint8) if dtype != torch.float32 else
                       rows.view(torch.int32),
                       want.view(torch.uint8) if dtype != torch.float32 else
                       want.view(torch.int32))
    lo, hi = want.amin(dim=1).float(), want.amax(dim=1).float()
    assert finite.tolist() == (torch.isfinite(lo) & torch.isfinite(hi)).tolist()
    assert fits.tolist() == fits_fp16(lo, hi).tolist()


def _copy_parts(parts):
    """Copy changed rows of any size in ``parts`` parts."""
    return _split(hostcodes, "_SPLIT_COPY_BYTES", parts)


def test_a_large_copy_runs_in_parts_on_the_pool(kernel_path, monkeypatch):
    """Above the split size the native copy runs its row parts on the pool's threads too;
    the copy and its flags are those of one call."""
    if kernel_path != "native":
        pytest.skip("the fallback copy is one index_select")
    x = torch.randn(40_000, 64)
    x[12344, 3] = float("nan")
    x[30000, 7] = 1e6
    idx = np.arange(0, 40_000, 2, dtype=np.int64)  # 5 MB of rows: above the split size
    rows = torch.empty(len(idx), 64)
    k = native.kernel()
    threads: set = set()
    real = k.gather_check_f32
    monkeypatch.setattr(k, "gather_check_f32",
                        lambda *a: (threads.add(threading.current_thread().name), real(*a))[1])
    finite, fits = hostcodes.copy_checked(x, idx, rows)
    assert len(threads) >= 2 if fp_mod._cores() > 1 else len(threads) == 1
    assert torch.equal(rows.view(torch.int32), x[torch.from_numpy(idx)].view(torch.int32))
    assert np.flatnonzero(~finite).tolist() == [12344 // 2]
    assert np.flatnonzero(~fits).tolist() == [12344 // 2, 30000 // 2]


def test_the_native_copy_runs_for_float32_rows(kernel_path, monkeypatch):
    calls = []
    k = native.kernel()
    if k is not None:
        real = k.gather_check_f32
        monkeypatch.setattr(k, "gather_check_f32",
                            lambda *a: (calls.append(1), real(*a))[1])
    x = torch.randn(50, 8)
    idx = np.array([3, 7, 49], dtype=np.int64)
    rows = torch.empty(3, 8)
    hostcodes.copy_checked(x, idx, rows)
    assert torch.equal(rows, x[torch.from_numpy(idx)])
    assert calls == ([1] if kernel_path == "native" else [])

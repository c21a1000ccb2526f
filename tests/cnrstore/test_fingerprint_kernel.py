"""The compiled fingerprint kernels (codec/_kernels.c) against the torch/numpy reference
path (the one CUDA runs, and the one where no kernel is built), for random shapes, dtypes,
row strides and alignments: short rows (the dense run prefetch, and the whole-row prefetch
of rows with gaps) and long rows (over the kernel's 2 KiB prefetch distance, prefetched
block by block into the next row), with and without a partial last word."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import without_native_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.codec import fingerprint as fp_mod
from cnrstore.codec import native
from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.codec.fpdiff import fingerprints_and_changes

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
          torch.uint8, torch.int16, torch.int64, torch.bool]


@pytest.fixture(autouse=True, scope="module")
def _kernel():
    if native.kernel(wait=True) is None:
        pytest.skip(f"no native kernel here: {native.status()['reason']}")


def _table(dtype, rows, width, gap, offset, seed):
    """rows x width of dtype, the rows `gap` elements apart beyond their width, starting
    `offset` elements into their storage: every row one dense run (the kernel's case)."""
    item = torch.empty((), dtype=dtype).element_size()
    stride = width + gap
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, ((rows * stride + offset + 1) * item,), dtype=torch.uint8,
                        generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    flat = raw.view(dtype)[offset:offset + rows * stride]
    return flat.view(rows, stride)[:, :width]


def _reference(x):
    with without_native_kernels():
        return row_fingerprints(x)


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 40),
       width=st.one_of(st.integers(0, 80), st.integers(250, 2200)),
       gap=st.sampled_from([0, 0, 1, 3, 64]), offset=st.integers(0, 9),
       split=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_the_reference_path(dtype, rows, width, gap, offset, split, seed):
    x = _table(dtype, rows, width, gap, offset, seed)
    saved = fp_mod._SPLIT_MIN_BYTES
    fp_mod._SPLIT_MIN_BYTES = 1 if split else saved  # parts on the pool, or one call
    try:
        got = row_fingerprints(x)
    finally:
        fp_mod._SPLIT_MIN_BYTES = saved
    assert torch.equal(got, _reference(x))


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 30),
       width=st.one_of(st.integers(0, 40), st.integers(500, 1500)),
       gap=st.sampled_from([0, 2]), offset=st.integers(0, 3), seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_diff_kernel_matches_the_reference_path(dtype, rows, width, gap, offset, seed, data):
    x = _table(dtype, rows, width, gap, offset, seed)
    ref = _reference(x)
    old = ref.clone()[: data.draw(st.integers(0, rows + 3))]
    flip = data.draw(st.lists(st.integers(0, max(0, len(old) - 1)), max_size=5))
    if len(old):
        old[flip] ^= 1
    fp, changed = fingerprints_and_changes(x, old)
    assert torch.equal(fp, ref)
    assert changed.tolist() == sorted(set(flip)) if len(old) else changed.tolist() == []


def test_long_rows_across_the_prefetch_block_edges():
    """Row lengths around the 2 KiB prefetch distance and its 512 B blocks, byte by byte
    (uint8 rows at an odd offset): every length hashes as the reference does."""
    for nbytes in [*range(2040, 2060), 2559, 2560, 2561, 4095, 4096, 4097, 4607, 4608]:
        x = _table(torch.uint8, 7, nbytes, 0, 3, nbytes)
        assert torch.equal(row_fingerprints(x), _reference(x)), nbytes
        y = _table(torch.uint8, 7, nbytes, 5, 1, nbytes)
        assert torch.equal(row_fingerprints(y), _reference(y)), nbytes


def test_the_build_runs_on_any_cpu_of_its_arch_and_its_key_covers_the_flags(monkeypatch):
    """One cached .so serves every CPU of the machine type: no command tunes for the build
    host (the AVX2/AVX-512 code is in target clones, chosen when the library loads), and a
    change of flags or compiler is a new file name, never a stale build."""
    for cmd in native._commands("cc", "out.so"):
        assert not any(f.startswith(("-march", "-mtune", "-mcpu", "-mavx")) for f in cmd), cmd
    key = native._target()
    monkeypatch.setattr(native, "_FLAGS", [*native._FLAGS, "-mavx2"])
    assert native._target() != key
    monkeypatch.undo()
    monkeypatch.setenv("CC", "some-other-cc")
    assert native._target() != key

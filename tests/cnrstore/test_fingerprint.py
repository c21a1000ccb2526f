"""Row fingerprints: determinism, sensitivity, layout independence, CPU/CUDA agreement."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from ckpt_util import on_kernel_path
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.codec import fingerprint as fp_mod
from cnrstore.codec import native
from cnrstore.codec.fingerprint import row_fingerprints

ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True, scope="module", params=["native", "numpy"])
def kernel_path(request):
    """Every test runs on both CPU paths: the compiled one-pass kernel (native.py) and the
    numpy/torch loop used where no kernel can be built. Module-scoped (hypothesis refuses
    function-scoped fixtures), so it patches by hand."""
    yield from on_kernel_path(request.param, fallback="numpy")


def _random_table(dtype, rows, width, seed):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0,
        256,
        (rows, width * torch.empty((), dtype=dtype).element_size()),
        dtype=torch.uint8,
        generator=gen,
    )
    if dtype == torch.bool:
        return raw[:, :width] % 2 == 1
    return raw.view(dtype)


def _reference(table: torch.Tensor) -> np.ndarray:
    """The documented construction, re-implemented independently with Python ints."""
    keys_a, keys_b = fp_mod._keys(torch.device("cpu"), 4096)
    keys_a = [int(k) & fp_mod._MASK64 for k in keys_a]
    keys_b = [int(k) & fp_mod._MASK64 for k in keys_b]
    m = fp_mod._MASK64
    data = table.reshape(table.shape[0], -1).contiguous()
    out = []
    for row in data:
        raw = row.view(torch.uint8).numpy().tobytes() if row.numel() else b""
        nbytes = len(raw)
        raw += b"\0" * (-nbytes % 8)
        h = 0
        for j in range(len(raw) // 8):
            w = int.from_bytes(raw[8 * j : 8 * j + 8], "little")
            y = ((w ^ keys_a[j]) * fp_mod._C) & m
            y ^= y >> 32
            h = (h + y * keys_b[j]) & m
        h ^= (nbytes * fp_mod._LEN_MUL) & m
        h ^= h >> 30
        h = (h * 0xBF58476D1CE4E5B9) & m
        h ^= h >> 27
        h = (h * 0x94D049BB133111EB) & m
        h ^= h >> 31
        out.append(h - (1 << 64) if h >= 1 << 63 else h)
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_matches_reference_construction(dtype):
    table = _random_table(dtype, 7, 5, seed=1)
    assert np.array_equal(row_fingerprints(table).numpy(), _reference(table))


def test_known_value_is_stable():
    # Stored fingerprints must stay comparable across versions: pin one value.
    table = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    got = row_fingerprints(table).tolist()
    assert got == _reference(table).tolist()
    assert len(set(got)) == 3


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_shapes_and_dtypes(dtype):
    table = _random_table(dtype, 33, 6, seed=2).reshape(33, 2, 3)
    fp = row_fingerprints(table)
    assert fp.dtype == torch.int64 and fp.shape == (33,)
    assert torch.equal(fp, row_fingerprints(table.reshape(33, 6)))
    assert torch.equal(fp[5:9], row_fingerprints(table[5:9]))
    distinct_rows = {bytes(r.contiguous().view(torch.uint8).numpy()) for r in table}
    assert len(set(fp.tolist())) == len(distinct_rows)


def test_zero_width_and_zero_rows():
    assert row_fingerprints(torch.zeros(0, 4)).shape == (0,)
    fp = row_fingerprints(torch.zeros(5, 0))
    assert fp.shape == (5,) and len(set(fp.tolist())) == 1
    one_d = torch.arange(10, dtype=torch.int32)
    assert len(set(row_fingerprints(one_d).tolist())) == 10


def test_length_is_mixed_in():
    # Zero padding must not alias: [0] and [0, 0] (and an empty row) differ.
    a = row_fingerprints(torch.zeros(1, 1, dtype=torch.int8))
    b = row_fingerprints(torch.zeros(1, 2, dtype=torch.int8))
    c = row_fingerprints(torch.zeros(1, 0, dtype=torch.int8))
    assert len({int(a), int(b), int(c)}) == 3


def test_out_parameter_and_errors():
    table = torch.randn(10, 3)
    out = torch.empty(10, dtype=torch.int64)
    res = row_fingerprints(table, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(out, row_fingerprints(table))
    with pytest.raises(ValueError, match="out must be int64"):
        row_fingerprints(table, out=torch.empty(9, dtype=torch.int64))
    with pytest.raises(ValueError, match="ndim >= 1"):
        row_fingerprints(torch.tensor(1.0))
    with pytest.raises(TypeError):
        row_fingerprints([1, 2, 3])


def test_chunking_and_buffer_reuse(monkeypatch):
    table = torch.randn(1000, 9)
    whole = row_fingerprints(table)
    monkeypatch.setattr(fp_mod, "_CPU_CHUNK_WORDS", 7 * 5)  # 7 rows of 5 words per chunk
    assert torch.equal(row_fingerprints(table), whole)
    assert torch.equal(row_fingerprints(table), whole)  # reused buffers, same answer


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    rows=st.integers(1, 300),
    width=st.integers(1, 20),
    strided=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_large_tables_split_across_cores_match_the_construction(dtype, rows, width, strided,
                                                                 seed):
    """A CPU table above the split size is hashed in row parts on several threads; every
    row's fingerprint is the documented construction's, whatever the parts."""
    base = _random_table(dtype, rows, 2 * width, seed)
    table = base[:, ::2] if strided else base[:, :width]
    old = fp_mod._SPLIT_MIN_BYTES
    fp_mod._SPLIT_MIN_BYTES = 1  # every table splits (when it has >1 row)
    try:
        got = row_fingerprints(table)
    finally:
        fp_mod._SPLIT_MIN_BYTES = old
    dense = table.clone(memory_format=torch.contiguous_format)
    assert np.array_equal(got.numpy(), _reference(dense))


def test_split_runs_parts_on_other_threads(monkeypatch):
    """The split is real: parts above the threshold run on the pool's threads too."""
    seen = set()
    real = fp_mod._finish

    def spy(table, words, nbytes, out):
        seen.add(threading.get_ident())
        real(table, words, nbytes, out)

    monkeypatch.setattr(fp_mod, "_finish", spy)
    monkeypatch.setattr(fp_mod, "_cores", lambda: 3)
    monkeypatch.setattr(fp_mod, "_split_pool", None)
    monkeypatch.setattr(fp_mod, "_SPLIT_MIN_BYTES", 1024)
    table = torch.randn(3000, 16)
    got = row_fingerprints(table)
    assert len(seen) >= 2
    monkeypatch.setattr(fp_mod, "_SPLIT_MIN_BYTES", 1 << 62)
    assert torch.equal(got, row_fingerprints(table))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_tables_hash_their_bytes(dtype):
    base = torch.randn(30, 14, dtype=dtype)
    table = base[:, ::2]
    fp = row_fingerprints(table)
    assert torch.equal(fp, row_fingerprints(table.contiguous()))
    real = torch.view_as_real(table.contiguous()).reshape(30, -1)  # same bytes
    assert torch.equal(fp, row_fingerprints(real))
    assert len(set(fp.tolist())) == 30


def test_non_contiguous_and_misaligned_views():
    base = torch.randn(40, 16)
    table = base[:, ::2]  # strided columns
    assert torch.equal(row_fingerprints(table), row_fingerprints(table.contiguous()))
    t = base.t()  # column-major
    assert torch.equal(row_fingerprints(t), row_fingerprints(t.contiguous()))
    raw = torch.randint(0, 256, (4 * 8 * 10 + 1,), dtype=torch.uint8)
    odd = raw[1:].view(10, 32)  # storage offset not 8-byte aligned
    assert torch.equal(row_fingerprints(odd), row_fingerprints(odd.clone()))


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES + [torch.int32, torch.int8]),
    rows=st.integers(1, 12),
    width=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_equal_rows_equal_and_changes_detected(dtype, rows, width, seed, data):
    table = _random_table(dtype, rows, width, seed)
    fp = row_fingerprints(table)
    # Equal rows give equal fingerprints, wherever they sit.
    dup = table[torch.zeros(rows, dtype=torch.long)]
    assert torch.equal(row_fingerprints(dup), fp[0].expand(rows))
    r = data.draw(st.integers(0, rows - 1))
    raw = table.clone().view(torch.uint8).reshape(rows, -1)
    nbits = raw.shape[1] * 8
    # One flipped bit.
    bit = data.draw(st.integers(0, nbits - 1))
    flipped = raw.clone()
    flipped[r, bit // 8] ^= 1 << (bit % 8)
    got = row_fingerprints(flipped.view(dtype).reshape(table.shape))
    assert got[r] != fp[r]
    assert torch.equal(torch.cat([got[:r], got[r + 1 :]]), torch.cat([fp[:r], fp[r + 1 :]]))


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    width=st.integers(2, 64),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_sign_flips_and_permutations_detected(dtype, width, seed, data):
    row = _random_table(dtype, 1, width, seed)
    base = int(row_fingerprints(row)[0])
    i = data.draw(st.integers(0, width - 1))
    j = data.draw(st.integers(0, width - 1).filter(lambda v: v != i))
    one = row.clone()
    one[0, i] = -one[0, i]
    two = one.clone()
    two[0, j] = -two[0, j]
    swapped = row.clone()
    swapped[0, [i, j]] = row[0, [j, i]]
    for changed in (one, two, swapped):
        if not torch.equal(changed.view(torch.uint8), row.view(torch.uint8)):
            assert int(row_fingerprints(changed)[0]) != base


def test_two_sign_flips_in_float64_words():
    # The case a linear sum of words * odd keys misses: bit 63 flipped in two words.
    row = torch.randn(1, 64, dtype=torch.float64)
    base = int(row_fingerprints(row)[0])
    seen = set()
    for i in range(0, 64, 3):
        for j in range(i + 1, 64, 5):
            two = row.clone()
            two[0, i] = -two[0, i]
            two[0, j] = -two[0, j]
            seen.add(int(row_fingerprints(two)[0]))
    assert base not in seen
    assert len(seen) == sum(1 for i in range(0, 64, 3) for _ in range(i + 1, 64, 5))


def test_no_collisions_among_many_similar_rows():
    # 100k rows differing in one low mantissa bit or one element: all distinct.
    base = torch.randn(1, 32)
    table = base.repeat(100_000, 1)
    raw = table.view(torch.int32)
    idx = torch.arange(100_000)
    raw[idx, idx % 32] ^= (idx // 32 + 1).to(torch.int32)
    fp = row_fingerprints(table)
    assert torch.unique(fp).numel() == 100_000


def test_nan_payloads_and_negative_zero_distinguished():
    a = torch.tensor([[0.0, 1.0]])
    b = torch.tensor([[-0.0, 1.0]])
    assert int(row_fingerprints(a)[0]) != int(row_fingerprints(b)[0])
    n1 = torch.tensor([[0x7FC00000, 0]], dtype=torch.int32).view(torch.float32)
    n2 = torch.tensor([[0x7FC00001, 0]], dtype=torch.int32).view(torch.float32)
    assert int(row_fingerprints(n1)[0]) != int(row_fingerprints(n2)[0])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_cpu_cuda_agree(dtype):
    table = _random_table(dtype, 5000, 37, seed=3)
    cpu = row_fingerprints(table)
    gpu = row_fingerprints(table.cuda())
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)
    strided = table.cuda()[::3, 1:]
    assert torch.equal(row_fingerprints(strided).cpu(), row_fingerprints(table[::3, 1:]))


def test_keys_make_two_top_bit_flips_detectable():
    # docs/QUANTIZATION.md: flipping bit 63 of words i and j collides only if
    # b_i +- b_j = 0 mod 2^33. Check the fixed keys never satisfy that (first 1024).
    _, b = fp_mod._keys(torch.device("cpu"), 1024)
    low = np.array([int(k) % 2**33 for k in b], dtype=np.int64)
    diff = (low[:, None] - low[None, :]) % 2**33
    total = (low[:, None] + low[None, :]) % 2**33
    off_diag = ~np.eye(1024, dtype=bool)
    assert not np.any((diff == 0) & off_diag)
    assert not np.any(total == 0)


def test_buffer_cache_is_bounded_per_device(kernel_path):
    if kernel_path == "native":
        pytest.skip("the kernel takes no buffers")
    for width in (3, 17, 64, 5, 130):
        row_fingerprints(torch.randn(300, width))
    cpu_sets = [k for k in fp_mod._buffer_cache if k[0] == "cpu"]
    assert len(cpu_sets) == 1
    held = fp_mod._buffer_cache[cpu_sets[0]]
    assert held[0].numel() <= fp_mod._CPU_CHUNK_WORDS + 130 // 8 + 1


def test_forked_child_fingerprints_while_a_parent_thread_held_the_locks():
    """A fork while another thread holds the module's cache locks must not leave the child
    with locks nobody will release (issue 8)."""
    fpm = fp_mod
    rows = torch.randn(64, 8)
    row_fingerprints(rows)  # warm the caches
    held, release = threading.Event(), threading.Event()

    def hold():
        with fpm._keys_lock, fpm._buffers_lock:
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:  # child: must finish well within the parent's wait
            code = 1
            try:
                row_fingerprints(torch.randn(64, 8))
                code = 0
            finally:
                os._exit(code)
        deadline = 20.0
        t0 = time.monotonic()
        while time.monotonic() - t0 < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("child hung on a lock held by a parent thread at fork")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        t.join()


def test_the_kernel_is_used_for_dense_rows_at_any_offset(kernel_path, monkeypatch):
    """Dense rows (any stride apart, any alignment, odd byte lengths) take the kernel when
    it is loaded; rows whose elements are strided take the loop. Both give the reference."""
    calls = []
    real = fp_mod._native_rows

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    monkeypatch.setattr(fp_mod, "_native_rows", spy)
    raw = torch.randint(0, 256, (40 * 37 + 3,), dtype=torch.uint8)
    cases = [raw[3:].view(40, 37), raw[:40 * 37].view(40, 37)[:, 1:30],
             torch.randn(40, 16)[::3], torch.randn(8, 3, 5)]
    for table in cases:
        assert np.array_equal(row_fingerprints(table).numpy(),
                              _reference(table.contiguous()))
    assert calls == [kernel_path == "native"] * len(cases)
    calls.clear()
    strided = torch.randn(40, 16)[:, ::2]
    assert np.array_equal(row_fingerprints(strided).numpy(), _reference(strided.contiguous()))
    assert calls == [False]


def test_kernel_builds_into_a_fresh_cache_and_can_be_disabled(kernel_path, tmp_path):
    """A fresh cache is built (what `python -m cnrstore.codec.native` does at set-up), and
    CNRSTORE_NATIVE=0 keeps the numpy path, saying why."""
    import subprocess
    import sys

    if kernel_path == "numpy":
        pytest.skip("runs once, in fresh processes")
    if native.kernel(wait=True) is None:
        pytest.skip(f"no native kernel here: {native.status()['reason']}")
    env = dict(os.environ, CNRSTORE_CACHE_DIR=str(tmp_path))
    probe = ("from cnrstore.codec import native\n"
             "fn = native.kernel(wait=True)\nprint(native.status()['state'])")
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.stdout.strip() == "loaded", run.stderr
    assert len(list((tmp_path / "native").glob("kernels-*.so"))) == 1
    env["CNRSTORE_NATIVE"] = "0"
    probe += "\nprint(native.status()['reason'])"
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.stdout.split("\n")[:2] == ["unavailable", "disabled by CNRSTORE_NATIVE=0"]

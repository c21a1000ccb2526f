"""The restore's page prefault (cnrstore/core/prefault.py): it maps a fresh output's pages
ahead of the decode without ever changing what the decode writes into them."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import pytest
import torch

import cnrstore
from cnrstore.core import prefault
from cnrstore.core.prefault import Prefault

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident_fraction(t: torch.Tensor) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = -(-t.data_ptr() // PAGE) * PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // PAGE * PAGE
    pages = (end - start) // PAGE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, end - start, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


@linux
def test_populates_a_fresh_tensor_and_leaves_written_data_alone():
    t = torch.empty((80 << 20) // 4, dtype=torch.float32)  # fresh mmap: nothing resident
    before = _resident_fraction(t)
    t[: 1 << 20] = 7.0  # written first: must survive
    p = Prefault([t])
    p.join()
    if prefault._broken:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert before < 0.5
    assert _resident_fraction(t) > 0.99
    assert bool((t[: 1 << 20] == 7.0).all())


@linux
def test_writes_racing_the_prefault_are_kept():
    n = (96 << 20) // 8
    t = torch.empty(n, dtype=torch.int64)
    want = torch.arange(n, dtype=torch.int64)
    p = Prefault([t])

    def write(lo: int, hi: int) -> None:
        for a in range(lo, hi, 1 << 16):
            t[a:a + (1 << 16)] = want[a:a + (1 << 16)]

    writers = [threading.Thread(target=write, args=(k * n // 2, (k + 1) * n // 2))
               for k in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    p.stop()
    assert torch.equal(t, want)


def test_small_tensors_are_left_alone():
    small = torch.empty(1000)
    Prefault([small]).stop()  # below the size: no thread
    assert Prefault([small])._thread is None


@linux
@pytest.mark.parametrize("quant", ["exact", "int8"])
def test_restores_with_the_prefault_are_exact(tmp_path, monkeypatch, quant):
    """Every restore into fresh tensors runs the prefault (the size bar lowered here): the
    latest step of a patched table restores exactly as without it."""
    ran = []
    real = Prefault._run

    def spy(self, spans):
        ran.extend(end - start for start, end in spans)
        real(self, spans)

    monkeypatch.setattr(prefault, "_MIN_BYTES", 0)
    monkeypatch.setattr(prefault, "_CHUNK", 3 * PAGE)
    monkeypatch.setattr(Prefault, "_run", spy)
    g = torch.Generator().manual_seed(5)
    t = torch.randn(5000, 24, generator=g)
    with cnrstore.open(tmp_path / "s", block_rows=512) as s:
        s.put_tables(1, {"t": t}, quant=quant)
        for step in (2, 3):
            rows = torch.randint(0, 5000, (300,), generator=g)
            t[rows] += 0.5
            s.put_tables(step, {"t": t}, quant=quant)
        want = s.get_tables(3)["t"]
    monkeypatch.setattr(prefault, "_MIN_BYTES", 1 << 62)
    with cnrstore.open(tmp_path / "s") as s:
        plain = s.get_tables(3)["t"]
    assert ran
    assert torch.equal(want, plain)
    if quant == "exact":
        assert torch.equal(want, t)

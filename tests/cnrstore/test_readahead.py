"""The restore's read-ahead (cnrstore/core/readahead.py): each block's chain is hinted in
decode order, never more than the window ahead of the decode."""

from __future__ import annotations

import threading
import time

import torch

import cnrstore
from cnrstore.core import readahead
from cnrstore.core.readahead import Readahead
from cnrstore.format.manifest import load_manifest


def _store_with_chains(path):
    g = torch.Generator().manual_seed(2)
    t = torch.randn(64 * 10, 8, generator=g)
    s = cnrstore.open(path, block_rows=64)
    s.put_tables(1, {"t": t})
    for step in (2, 3):
        t[torch.arange(0, 640, 64)] += 1.0  # a row of every block: a patch per block
        s.put_tables(step, {"t": t})
    return s, t


def test_hints_follow_the_decode_within_the_window(tmp_path, monkeypatch):
    s, t = _store_with_chains(tmp_path / "s")
    try:
        tm = load_manifest(s.objects, 3).tables["t"]
        hinted: list[tuple[int, int]] = []  # (block index, blocks begun when hinted)
        begun = [0]
        index = {oid: i for i, oid in enumerate(tm.block_ids)}
        lock = threading.Lock()
        done = threading.Event()

        def spy(locs):
            locs = list(locs)
            blocks = [index[loc.oid] for loc in locs if loc.oid in index]
            assert len(blocks) == 1 and len(locs) == 3  # the block, its patch, its base
            with lock:
                hinted.append((blocks[0], begun[0]))
                if len(hinted) == len(tm.block_ids):
                    done.set()

        monkeypatch.setattr(s.objects._core, "advise", spy)  # what prefetch hints
        block_nbytes = 64 * 8 * 4
        monkeypatch.setattr(readahead, "WINDOW_BYTES", 3 * block_nbytes)  # 3 blocks
        ra = Readahead(s.objects, tm.block_ids, block_nbytes)
        deadline = time.monotonic() + 30
        while len(hinted) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        with lock:
            assert [b for b, _ in hinted] == [0, 1, 2]  # the window, and no further
        for k in range(len(tm.block_ids)):
            with lock:
                begun[0] = k + 1
            ra.started(k)
        assert done.wait(10)
        ra.stop()
        assert [b for b, _ in hinted] == list(range(len(tm.block_ids)))
        assert all(b < n + 3 for b, n in hinted)
        assert torch.equal(s.get_tables(3)["t"], t)
    finally:
        s.close()


def test_stop_ends_a_waiting_thread_and_a_closed_store_gives_no_hints(tmp_path):
    s, _ = _store_with_chains(tmp_path / "s")
    tm = load_manifest(s.objects, 3).tables["t"]
    ra = Readahead(s.objects, tm.block_ids, 1 << 30)  # window of 2 blocks: it waits
    time.sleep(0.05)
    ra.stop()
    assert not ra._thread.is_alive()
    s.close()
    late = Readahead(s.objects, tm.block_ids, 1)  # the closed store raises: nothing hinted
    late.stop()

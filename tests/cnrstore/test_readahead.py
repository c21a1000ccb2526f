"""The restore's read-ahead (cnrstore/core/readahead.py): each block's chain is hinted in
decode order, never more than the window ahead of the decode, by the threads that
decode (no thread of its own)."""

from __future__ import annotations

import threading

import torch

import cnrstore
from cnrstore.core import readahead
from cnrstore.core.readahead import Readahead
from cnrstore.format.load import load_manifest


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
        threads = threading.active_count()
        ra = Readahead(s.objects, tm.block_ids, block_nbytes)
        with lock:
            assert [b for b, _ in hinted] == [0, 1, 2]  # the window at once, no further
        for k in range(len(tm.block_ids)):
            with lock:
                begun[0] = k + 1
            ra.started(k)
            assert len(hinted) == min(k + 4, len(tm.block_ids))  # in this thread, now
        assert done.is_set() and threading.active_count() == threads
        assert [b for b, _ in hinted] == list(range(len(tm.block_ids)))
        assert all(b < n + 3 for b, n in hinted)
        assert torch.equal(s.get_tables(3)["t"], t)
    finally:
        s.close()


def test_threads_racing_hint_each_block_once_and_a_closed_store_gives_no_hints(
        tmp_path, monkeypatch):
    s, _ = _store_with_chains(tmp_path / "s")
    tm = load_manifest(s.objects, 3).tables["t"]
    hinted: list[bytes] = []
    advise = s.objects._core.advise

    def spy(locs):
        locs = list(locs)
        hinted.extend(loc.oid for loc in locs if loc.oid in tm.block_ids)
        advise(locs)

    monkeypatch.setattr(s.objects._core, "advise", spy)
    ra = Readahead(s.objects, tm.block_ids, 1 << 30)  # window of 2 blocks
    go = threading.Barrier(2)

    def decode(ks):
        go.wait()
        for k in ks:
            ra.started(k)

    workers = [threading.Thread(target=decode, args=(range(i, 10, 2),)) for i in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(hinted) == sorted(tm.block_ids) and len(hinted) == 10
    s.close()
    late = Readahead(s.objects, tm.block_ids, 1)  # the closed store raises: nothing hinted
    late.started(0)
    assert len(hinted) == 10


def test_one_read_ahead_runs_on_into_the_next_table(tmp_path, monkeypatch):
    """One read-ahead over several tables (in-place restores, a rank's reads): the next
    table's first blocks are hinted while the decode is still in the last blocks of the
    one before (hints per table left the disk idle at every table's start). A get_tables
    of a pack store reads in windows and hints nothing (test_windowread.py)."""
    g = torch.Generator().manual_seed(3)
    tables = {"a": torch.randn(64 * 2, 8, generator=g), "b": torch.randn(64 * 4, 8, generator=g)}
    with cnrstore.open(tmp_path / "s", block_rows=64) as s:
        s.put_tables(1, tables)
    with cnrstore.open(tmp_path / "s") as s:
        m = load_manifest(s.objects, 1)
        a, b = m.tables["a"].block_ids, m.tables["b"].block_ids
        hinted: list[bytes] = []
        monkeypatch.setattr(s.objects._core, "advise",
                            lambda locs: hinted.extend(loc.oid for loc in locs))
        monkeypatch.setattr(readahead, "WINDOW_BYTES", 3 * 64 * 8 * 4)  # 3 blocks
        in_a, in_b = readahead.table_blocks(s.objects, [(a, 64 * 8 * 4), (b, 64 * 8 * 4)])
        assert hinted == [a[0], a[1], b[0]]
        in_a(0)
        in_a(1)
        assert hinted == [a[0], a[1], b[0], b[1], b[2]]
        in_b(0)
        assert hinted[-1] == b[3] and len(hinted) == 6
        # and an in-place restore hints every block once, in decode order
        hinted.clear()
        dest = {n: torch.zeros_like(t) for n, t in tables.items()}
        s.get_tables(1, out=dest)
        assert sorted(hinted) == sorted([*a, *b]) and hinted[:2] == [a[0], a[1]]
        assert all(torch.equal(dest[n], t) for n, t in tables.items())

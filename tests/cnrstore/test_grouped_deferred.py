"""A tracker-driven non-blocking put of the grouped layout is planned on the writer thread
(core/groupdefer.py): the stall copies the touched rows, the writer runs the block policy
and reads the rows its cleaner writes again from the objects holding their last copies.
It must store exactly what a blocking put stores (same ids, same rows), with the table
changed right after the put returns, across a reopen, and fail cleanly, not wrongly, when
an object it reads is damaged."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from ckpt_util import assert_identical
from test_damaged_base import _rot

import cnrstore
from cnrstore.core import groupdefer, grouppolicy
from cnrstore.errors import CheckpointError
from cnrstore.format.load import load_manifest

OPTS = {"block_rows": 64, "fanout": 4, "layout": "grouped", "compression_level": 0}
ROWS, WIDTH = 400, 8


def _steps(seed: int, steps: int):
    """Per step: the rows it updates (Zipf-skewed, so the cleaner has stale objects to
    drop), their new values, and what a tracker reports (those rows, rows only looked up,
    repeats, unsorted)."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    hot = rng.permutation(ROWS)
    out = []
    for _ in range(steps):
        rows = np.unique(hot[np.minimum(rng.zipf(1.3, size=40) - 1, ROWS - 1)])
        looked = rng.choice(ROWS, size=10, replace=False)
        r = torch.from_numpy(rows)
        out.append((r, torch.randn(len(rows), WIDTH, generator=g),
                    torch.from_numpy(np.concatenate([looked, rows[::-1], rows[:2]]))))
    return out


def _table(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed + 1))


class _Spy:
    """The steps whose block policy ran on the caller's thread, and the row objects read
    back."""

    def __init__(self, monkeypatch):
        self.caller = threading.get_ident()
        self.on_caller: set[int] = set()
        self.policy_runs = 0
        self.reads = 0
        policy, decode = grouppolicy.next_group, groupdefer.decode_rows_object

        def next_group(old, changed, step, row_nbytes):
            self.policy_runs += 1
            if threading.get_ident() == self.caller:
                self.on_caller.add(step)
            return policy(old, changed, step, row_nbytes)

        def read(*a, **k):
            self.reads += 1
            return decode(*a, **k)

        monkeypatch.setattr(grouppolicy, "next_group", next_group)
        monkeypatch.setattr(groupdefer, "decode_rows_object", read)


def _run(path, scheme: str, steps: list, *, tracked: bool, reopen_at: int = 0):
    t = _table(0)
    infos, futs = [], []
    s = cnrstore.open(path, **OPTS)
    try:
        s.put_tables(0, {"t": t}, quant=scheme)
        for step, (rows, vals, looked) in enumerate(steps, start=1):
            if step == reopen_at:
                for f in futs:
                    infos.append(f.result(timeout=60))
                futs = []
                s.close()
                s = cnrstore.open(path, **OPTS)
            t[rows] = vals  # in place, as training does, also while a put is queued
            if tracked:
                futs.append(s.put_tables(step, {"t": t}, quant=scheme, blocking=False,
                                         touched={"t": looked}))
            else:
                infos.append(s.put_tables(step, {"t": t}, quant=scheme))
        infos += [f.result(timeout=60) for f in futs]
        got = {step: s.get_tables(step)["t"] for step in range(len(steps) + 1)}
        assert s.verify().ok
    finally:
        s.close()
    return infos, got


@pytest.mark.parametrize("scheme", ["exact", "int8", "int4"])
def test_deferred_grouped_puts_store_what_blocking_puts_store(tmp_path, scheme, monkeypatch):
    steps = _steps(5, 40)
    want, want_rows = _run(tmp_path / "blocking", scheme, steps, tracked=False)
    spy = _Spy(monkeypatch)
    got, got_rows = _run(tmp_path / "tracked", scheme, steps, tracked=True)
    assert [i.tables for i in got] == [i.tables for i in want]
    assert [i.rows_changed for i in got] == [i.rows_changed for i in want]
    for step, rows in want_rows.items():
        assert_identical(got_rows[step], rows)
    # the cleaner wrote rows that did not change, read back from the store, and the
    # policy never ran on the caller's thread
    assert any(i.rows_written["t"] > i.rows_changed["t"] for i in got)
    assert spy.reads > 0
    assert spy.policy_runs and not spy.on_caller


@pytest.mark.parametrize("scheme", ["exact", "int8"])
def test_a_reopened_handle_plans_on_the_writer_from_the_stored_lists(tmp_path, scheme,
                                                                     monkeypatch):
    """Reopened, the first put seeds its base from the store in its stall (no
    fingerprints to diff touched rows against yet), so it plans there; the puts after it
    plan on the writer, reading rows from objects the reopened handle did not write."""
    steps = _steps(7, 30)
    want, _ = _run(tmp_path / "blocking", scheme, steps, tracked=False, reopen_at=15)
    spy = _Spy(monkeypatch)
    got, _ = _run(tmp_path / "tracked", scheme, steps, tracked=True, reopen_at=15)
    assert [i.tables for i in got] == [i.tables for i in want]
    assert spy.reads > 0
    assert spy.on_caller == {15}


def _listed(s, step: int) -> set[bytes]:
    """The row objects the block lists of ``step`` name."""
    out: set[bytes] = set()
    for i, oid in enumerate(load_manifest(s.objects, step).tables["t"].block_ids):
        group = grouppolicy.load_group(s.objects.get, oid, min(64, ROWS - 64 * i), WIDTH * 4)
        assert group is not None
        out |= {p.oid for p in group.pieces if p.oid is not None}
    return out


def test_a_damaged_object_the_cleaner_reads_fails_the_put_and_the_next_put_heals(tmp_path):
    """A row the cleaner writes again whose last copy cannot be read is not in the copy
    and no longer in the table as it was: the put fails (nothing committed, no wrong
    rows), and the next put, untracked, writes it from the table."""
    steps = _steps(9, 40)
    want, _ = _run(tmp_path / "blocking", "exact", steps, tracked=False)
    # the first step whose put writes rows again without them having changed, and the
    # objects it drops (the ones its cleaner reads)
    clean = next(n for n, i in enumerate(want, start=1)
                 if i.rows_written["t"] > i.rows_changed["t"])
    with cnrstore.open(tmp_path / "blocking", **OPTS) as s:
        dropped = _listed(s, clean - 1) - _listed(s, clean)
    assert dropped
    path = tmp_path / "tracked"
    t = _table(0)
    with cnrstore.open(path, **OPTS) as s:
        s.put_tables(0, {"t": t}, quant="exact")
        for step, (rows, vals, looked) in enumerate(steps[:clean - 1], start=1):
            t[rows] = vals
            s.put_tables(step, {"t": t}, quant="exact", blocking=False,
                         touched={"t": looked}).result(timeout=60)
        for oid in dropped:  # the same ids as the blocking store's
            _rot(path, s.objects.get(oid).payload)
        rows, vals, looked = steps[clean - 1]
        t[rows] = vals
        fut = s.put_tables(clean, {"t": t}, quant="exact", blocking=False,
                           touched={"t": looked})
        with pytest.raises(CheckpointError, match="corrupt"):
            fut.result(timeout=60)
        assert clean not in s.steps()
        info = s.put_tables(clean, {"t": t}, quant="exact", blocking=False,
                            touched={"t": looked}).result(timeout=60)
        assert info.tables == want[clean - 1].tables
        assert_identical(s.get_tables(clean)["t"], t)


# Another process drops every step of the store and puts a new one under the name of the
# handle's newest, so every object the handle's base names is gone.
_SWEEP = f"""
import sys, torch, cnrstore
path, last = sys.argv[1], int(sys.argv[2])
with cnrstore.open(path) as s:
    s.delete_steps(s.steps())
    s.gc(threshold=0.0)
    s.put_tables(last, {{"t": torch.zeros({ROWS}, {WIDTH})}}, quant="exact")
"""


def test_a_store_swept_by_another_process_is_written_whole(tmp_path):
    """The stall finds the base's anchor replaced and forgets the slots whose objects are
    gone (TableState.revalidate): every block, touched or not, is copied in the stall and
    written whole (a block no touched row fell in was neither copied nor written before:
    the writer refused the put as a bug)."""
    import subprocess
    import sys

    steps = _steps(9, 12)
    path = tmp_path / "tracked"
    t = _table(0)
    with cnrstore.open(path, **OPTS) as s:
        s.put_tables(0, {"t": t}, quant="exact")
        for step, (rows, vals, looked) in enumerate(steps[:-1], start=1):
            t[rows] = vals
            s.put_tables(step, {"t": t}, quant="exact", blocking=False,
                         touched={"t": looked}).result(timeout=60)
        last = len(steps)
        subprocess.run([sys.executable, "-c", _SWEEP, str(path), str(last - 1)],
                       check=True, timeout=120)
        rows, vals, looked = steps[-1]
        t[rows] = vals
        info = s.put_tables(last, {"t": t}, quant="exact", blocking=False,
                            touched={"t": looked[:5]}).result(timeout=60)
        assert info.rows_written["t"] == ROWS
        assert s.steps() == [last - 1, last]
        assert_identical(s.get_tables(last)["t"], t)
        assert s.verify().ok

"""A tracker-driven non-blocking put is planned on the writer thread (core/writerplan.py):
the stall copies the touched rows and the chain blocks it may rewrite or merge, the writer
runs the layout's block policy, and a grouped cleaner's copies of rows that did not change
are read from the store. It must store exactly what a blocking put stores (same ids, same
rows), with the table changed while puts are queued, across a reopen, after another
process swept the store, and fail cleanly, not wrongly, when an object it reads is
damaged."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from ckpt_util import assert_identical
from test_damaged_base import _rot

import cnrstore
from cnrstore.core import blockplan, grouppolicy, writerplan
from cnrstore.errors import CheckpointError
from cnrstore.format.blocks import KIND_BLOCK_FULL
from cnrstore.format.load import load_manifest

LAYOUTS = {
    "grouped": {"block_rows": 64, "fanout": 4, "layout": "grouped", "compression_level": 0},
    # a short chain bound: full rewrites and merged patches within a few steps
    "chains": {"block_rows": 64, "fanout": 4, "max_chain": 2, "compression_level": 0},
}
ROWS, WIDTH = 400, 8


def _steps(seed: int, steps: int):
    """Per step: the rows it updates (Zipf-skewed, so blocks are rewritten and objects
    cleaned), their new values, and what a tracker reports (those rows, rows only looked
    up, repeats, unsorted)."""
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
    """The steps whose block policy ran on the caller's thread, and the stored versions
    read back."""

    def __init__(self, monkeypatch):
        self.caller = threading.get_ident()
        self.on_caller: set[int] = set()
        self.policy_runs = 0
        self.reads = 0
        group, chain = grouppolicy.next_group, blockplan.next_slot
        decode = writerplan.decode_rows_object

        def next_group(old, changed, step, row_nbytes):
            self._ran(step)
            return group(old, changed, step, row_nbytes)

        def next_slot(*a, **k):
            self._ran(None)
            return chain(*a, **k)

        def counted(fn):
            def read(*a, **k):
                self.reads += 1
                return fn(*a, **k)
            return read

        self.step = 0
        monkeypatch.setattr(grouppolicy, "next_group", next_group)
        monkeypatch.setattr(blockplan, "next_slot", next_slot)
        monkeypatch.setattr(writerplan, "decode_rows_object", counted(decode))

    def _ran(self, step: int | None) -> None:
        self.policy_runs += 1
        if threading.get_ident() == self.caller:
            self.on_caller.add(self.step if step is None else step)


def _run(path, layout: str, scheme: str, steps: list, *, tracked: bool, reopen_at: int = 0,
         spy: _Spy | None = None):
    t = _table(0)
    infos, futs = [], []
    opts = LAYOUTS[layout]
    s = cnrstore.open(path, **opts)
    try:
        s.put_tables(0, {"t": t}, quant=scheme)
        for step, (rows, vals, looked) in enumerate(steps, start=1):
            if spy is not None:
                spy.step = step
            if step == reopen_at:
                for f in futs:
                    infos.append(f.result(timeout=60))
                futs = []
                s.close()
                s = cnrstore.open(path, **opts)
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


@pytest.mark.parametrize("layout", ["chains", "grouped"])
@pytest.mark.parametrize("scheme", ["exact", "int8", "int4"])
def test_writer_plans_store_what_blocking_puts_store(tmp_path, layout, scheme, monkeypatch):
    steps = _steps(5, 40)
    want, want_rows = _run(tmp_path / "blocking", layout, scheme, steps, tracked=False)
    spy = _Spy(monkeypatch)
    got, got_rows = _run(tmp_path / "tracked", layout, scheme, steps, tracked=True, spy=spy)
    assert [i.tables for i in got] == [i.tables for i in want]
    assert [i.rows_changed for i in got] == [i.rows_changed for i in want]
    for step, rows in want_rows.items():
        assert_identical(got_rows[step], rows)
    # blocks wrote rows that did not change (a grouped cleaner's read back from the
    # store, a chain's from the stall's copy), and the policy never ran on the caller's
    # thread
    assert any(i.rows_written["t"] > i.rows_changed["t"] for i in got)
    assert spy.reads > 0 if layout == "grouped" else spy.reads == 0
    assert spy.policy_runs and not spy.on_caller


@pytest.mark.parametrize("layout", ["chains", "grouped"])
@pytest.mark.parametrize("scheme", ["exact", "int8"])
def test_a_reopened_handle_plans_on_the_writer_from_the_stored_versions(tmp_path, layout,
                                                                       scheme, monkeypatch):
    """Reopened, the first put seeds its base from the store; where that base has no
    fingerprints yet to diff touched rows against (they are computed beside the put), it
    plans in its stall. The puts after it plan on the writer, reading rows from objects
    the reopened handle did not write."""
    steps = _steps(7, 30)
    want, _ = _run(tmp_path / "blocking", layout, scheme, steps, tracked=False, reopen_at=15)
    spy = _Spy(monkeypatch)
    got, _ = _run(tmp_path / "tracked", layout, scheme, steps, tracked=True, reopen_at=15,
                  spy=spy)
    assert [i.tables for i in got] == [i.tables for i in want]
    assert spy.reads > 0 if layout == "grouped" else spy.reads == 0
    assert spy.on_caller <= {15}


def _listed(s, step: int) -> set[bytes]:
    """The row objects the grouped block lists of ``step`` name."""
    out: set[bytes] = set()
    for i, oid in enumerate(load_manifest(s.objects, step).tables["t"].block_ids):
        group = grouppolicy.load_group(s.objects.get, oid, min(64, ROWS - 64 * i), WIDTH * 4)
        assert group is not None
        out |= {p.oid for p in group.pieces if p.oid is not None}
    return out


def test_a_damaged_object_the_cleaner_reads_fails_the_put_and_the_next_put_heals(tmp_path):
    """A row the grouped cleaner writes again whose last copy cannot be read is not in the
    copy and no longer in the table as it was: the put fails (nothing committed, no wrong
    rows), and the next put, untracked, writes it from the table."""
    steps = _steps(9, 40)
    want, _ = _run(tmp_path / "blocking", "grouped", "exact", steps, tracked=False)
    with cnrstore.open(tmp_path / "blocking", **LAYOUTS["grouped"]) as s:
        # the first step that writes again rows that did not change, and the objects it
        # drops (the ones its cleaner reads)
        clean, read = next((n, _listed(s, n - 1) - _listed(s, n))
                           for n, i in enumerate(want, start=1)
                           if i.rows_written["t"] > i.rows_changed["t"])
    assert read
    path = tmp_path / "tracked"
    t = _table(0)
    with cnrstore.open(path, **LAYOUTS["grouped"]) as s:
        s.put_tables(0, {"t": t}, quant="exact")
        for step, (rows, vals, looked) in enumerate(steps[:clean - 1], start=1):
            t[rows] = vals
            s.put_tables(step, {"t": t}, quant="exact", blocking=False,
                         touched={"t": looked}).result(timeout=60)
        for oid in read:  # the same ids as the blocking store's
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


def test_a_chain_rewrite_takes_its_rows_from_the_stall_not_the_store(tmp_path):
    """A chain block the put rewrites whole was copied in the stall: its stored version,
    damaged, is not read, and the step restores exactly."""
    steps = _steps(9, 40)
    want, _ = _run(tmp_path / "blocking", "chains", "exact", steps, tracked=False)
    with cnrstore.open(tmp_path / "blocking", **LAYOUTS["chains"]) as s:
        def rewritten(n: int) -> set[bytes]:
            before = load_manifest(s.objects, n - 1).tables["t"].block_ids
            after = load_manifest(s.objects, n).tables["t"].block_ids
            return {b for b, a in zip(before, after)
                    if a != b and s.objects.get(a).kind == KIND_BLOCK_FULL}
        full, read = next((n, r) for n in range(1, len(steps) + 1) if (r := rewritten(n)))
    path = tmp_path / "tracked"
    t = _table(0)
    with cnrstore.open(path, **LAYOUTS["chains"]) as s:
        s.put_tables(0, {"t": t}, quant="exact")
        for step, (rows, vals, looked) in enumerate(steps[:full], start=1):
            t[rows] = vals
            if step == full:
                for oid in read:
                    _rot(path, s.objects.get(oid).payload)
            info = s.put_tables(step, {"t": t}, quant="exact", blocking=False,
                                touched={"t": looked}).result(timeout=60)
        assert info.tables == want[full - 1].tables
        assert_identical(s.get_tables(full)["t"], t)


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


@pytest.mark.parametrize("layout", ["chains", "grouped"])
def test_a_store_swept_by_another_process_is_written_whole(tmp_path, layout):
    """The stall finds the base's anchor replaced and forgets the slots whose objects are
    gone (TableState.revalidate): every block, touched or not, is copied in the stall and
    written whole (a block no touched row fell in was neither copied nor written before:
    the writer refused the put as a bug)."""
    steps = _steps(9, 12)
    path = tmp_path / "tracked"
    t = _table(0)
    with cnrstore.open(path, **LAYOUTS[layout]) as s:
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

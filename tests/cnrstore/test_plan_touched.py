"""A put planned from the caller's touched rows (core/snapshot.py) finds what a put
planned from the whole table's fingerprints finds: the same changed rows, the same new
fingerprints and the same codes, on contiguous tables and on strided views of one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.core.snapshot import plan_table

R = 256


def _plan(x, base, touched=None):
    return plan_table("t", x, scheme="exact", base=base, block_rows=R, fanout=16,
                      max_chain=8, touched=touched)


@pytest.mark.parametrize("view", ["contiguous", "columns", "rows_strided"])
def test_touched_plan_equals_fingerprint_plan(view):
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2 * 1000, 24, generator=g)
    pick = {"contiguous": lambda t: t[:1000].contiguous(),
            "columns": lambda t: t[:1000, 4:20],       # rows strided by 24, not contiguous
            "rows_strided": lambda t: t[::2]}[view]
    x = pick(full)
    base = _plan(x, None).state
    changed = torch.tensor([0, 5, 6, 255, 256, 700, 999])
    looked_up = torch.tensor([1, 2, 400])              # touched, but hold what they held
    for r in changed.tolist():
        full_row = r if view != "rows_strided" else 2 * r
        full[full_row, 4:20] += 1.0
    x = pick(full)
    touched = torch.cat([changed, looked_up, changed[:3]])  # unsorted, with repeats
    by_touch, by_fp = _plan(x, base, touched), _plan(x, base)
    assert by_touch.rows_changed == by_fp.rows_changed == len(changed)
    assert torch.equal(by_touch.state.fingerprints, row_fingerprints(x))
    assert torch.equal(by_touch.state.fingerprints, by_fp.state.fingerprints)
    assert [(w.index, w.kind, None if w.rows is None else w.rows.tolist())
            for w in by_touch.writes] == [(w.index, w.kind, None if w.rows is None
                                           else w.rows.tolist()) for w in by_fp.writes]
    assert np.array_equal(by_touch.codes, by_fp.codes)


def test_no_touched_rows_changes_nothing():
    x = torch.randn(600, 8)
    base = _plan(x, None).state
    p = _plan(x, base, torch.zeros(0, dtype=torch.int64))
    assert p.rows_changed == 0 and p.writes == []
    assert torch.equal(p.state.fingerprints, base.fingerprints)


def _writes(p):
    """What a plan writes, down to each patch's base (its last version, or, merged, its
    chain's full block)."""
    return [(w.index, w.kind, w.start, w.stop, None if w.rows is None else w.rows.tolist(),
             None if w.base is None else w.base is p.base_slots[w.index]) for w in p.writes]


def _slots(state):
    return [None if s is None else (s.nrows, s.depth, s.chain_bytes,
                                    None if s.union is None else s.union.tolist())
            for s in state.slots]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_plan_deferred_to_the_writer_is_the_plan_made_at_once(seed):
    # A non-blocking put's tracker-driven plan (``defer_plan``) copies the touched rows and
    # the blocks it may write whole in the stall, and is made from that copy later: the
    # same writes, codes, slots and fingerprints as the plan made at once, over a run of
    # puts whose chains go through patches, merged patches and full rewrites, the table
    # overwritten as soon as the deferred put returns (training goes on).
    from cnrstore.core.hostcodes import HostBuffers

    def plan(x, base, touched, defer):
        return plan_table("t", x, scheme="exact", base=base, block_rows=32, fanout=4,
                          max_chain=3, touched=touched, buffers=HostBuffers(),
                          defer_plan=defer)

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200, 4, generator=g)
    eager = deferred = plan(x, None, None, False).state
    hot = torch.randint(0, 200, (30,), generator=g)
    kinds = set()
    for _ in range(25):
        changed = hot[torch.randint(0, len(hot), (10,), generator=g)]
        changed = torch.cat([changed, torch.randint(0, 200, (3,), generator=g)])
        x[changed] += 1.0
        touched = torch.cat([changed, torch.randint(0, 200, (4,), generator=g)])
        now = plan(x.clone(), eager, touched, False)
        held = x.clone()
        later = plan(held, deferred, touched, True)
        assert later.plan_later is not None and later.writes == []
        held.fill_(float("nan"))  # the caller's table moves on before the writer plans
        later.encoded()
        assert later.rows_changed == now.rows_changed
        assert _writes(later) == _writes(now)
        assert np.array_equal(later.codes, now.codes)
        assert torch.equal(later.state.fingerprints, now.state.fingerprints)
        assert _slots(later.state) == _slots(now.state)
        kinds |= {(w[1], w[5]) for w in _writes(now)}
        later.release()
        eager, deferred = now.state, later.state
    # full blocks, patches on their last version, merged patches on the full block
    assert kinds == {(0, None), (1, True), (1, False)}


def test_a_deferred_plan_never_made_leaves_a_base_that_writes_full():
    # Its put failed before the writer planned it: the release unblocks a put diffing
    # against its state, and that put finds no diff data (every block full: never wrong).
    from cnrstore.core.hostcodes import HostBuffers

    kw = dict(scheme="exact", block_rows=32, fanout=4, max_chain=3, buffers=HostBuffers())
    x = torch.randn(100, 4)
    base = plan_table("t", x, base=None, **kw).state
    x[5] += 1.0
    p = plan_table("t", x, base=base, touched=torch.tensor([5]), defer_plan=True, **kw)
    p.release()
    again = plan_table("t", x, base=p.state, touched=torch.tensor([5]), defer_plan=True,
                       **kw)
    assert again.plan_later is None  # no diff base: planned at once, every block full
    assert [w.kind for w in again.writes] == [0, 0, 0, 0]

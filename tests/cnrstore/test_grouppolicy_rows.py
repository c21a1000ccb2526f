"""The grouped writer's policy computes its rows' counts and classes for the rows it asks
about only (core/grouppolicy.py ``_classes``): the changed rows, then those it writes.
Whatever the version, step and rows, that is what the whole block's arrays (the policy
as it was, ``_whole_block`` here) give those rows, and ``next_group`` plans exactly the
write the whole-block policy planned: the same rows, objects, sizes and writer state, so
the stored bytes and ids do not change."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.core import grouppolicy as gp
from cnrstore.format.rowlists import rate_code, rate_value


def _whole_block(old, changed, step):
    """(codes, classes) of every row of the block, as next_group computed them before."""
    pstep = np.array([p.step for p in old.pieces], dtype=np.int64)
    pcls = np.array([p.cls for p in old.pieces], dtype=np.int64)
    owner = old.owner.astype(np.int64)
    if old.born is not None:
        rate, counts = gp.counted_rates(old.rq, pstep[owner], changed, step, old.born)
    else:
        rate = rate_value(old.rq) * (1.0 - gp.ALPHA) ** (step - pstep[owner]).astype(
            np.float64)
        rate[changed] += gp.ALPHA
        counts = rate_code(rate)
    cur = pcls[owner]
    th = np.asarray(gp.THRESHOLDS)
    up = np.searchsorted(th, rate, side="right")
    down = np.searchsorted(th * gp.HYSTERESIS, rate, side="right")
    return counts, np.where(up > cur, up, np.where(down < cur, down, cur))


def _version(data):
    """(the test's generator, a drawn block version, a step after its pieces')."""
    g = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    nrows = data.draw(st.integers(1, 5000))
    npieces = data.draw(st.integers(1, 40))
    born = data.draw(st.sampled_from([None, 0, 3, 600]))
    first = 0 if born is None else born
    steps = np.sort(g.integers(first, first + 1500, npieces))
    pieces = [gp.Piece(None, int(g.integers(0, 9)), int(s), 0, int(g.integers(40, 9000)))
              for s in steps]
    owner = g.integers(0, npieces, nrows).astype(np.int32)
    rq = g.integers(0, 256, nrows).astype(np.uint8)
    if born is not None:
        rq = np.where(g.random(nrows) < 0.2, 255, np.minimum(rq, gp.COUNT_CAP)).astype(np.uint8)
    step = int(steps[-1]) + data.draw(st.integers(1, 700))
    return g, gp.ListedVersion(pieces, owner, rq, born=born), step


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_rows_asked_get_what_the_whole_block_gives_them(data):
    g, old, step = _version(data)
    nrows = len(old.owner)
    changed = np.sort(g.choice(nrows, size=data.draw(st.integers(0, nrows)), replace=False))
    pstep = np.array([p.step for p in old.pieces], dtype=np.int64)
    pcls = np.array([p.cls for p in old.pieces], dtype=np.int64)
    of = gp._classes(old, pstep, pcls, changed, step)
    codes, classes = _whole_block(old, changed, step)
    for rows in (changed, np.sort(g.choice(nrows, size=min(nrows, 300), replace=False)),
                 np.arange(nrows)):
        got_codes, got_classes = of(rows)
        assert np.array_equal(got_codes, codes[rows].astype(np.uint8))
        assert np.array_equal(got_classes, classes[rows])


def _whole_block_next_group(old, changed, step, rnb):
    """next_group with _classes answering from the whole block's arrays."""
    real = gp._classes

    def whole(old, pstep, pcls, changed, step):
        codes, classes = _whole_block(old, changed, step)
        return lambda rows: (codes[rows].astype(np.uint8), classes[rows])

    gp._classes = whole
    try:
        return gp.next_group(old, changed, step, rnb)
    finally:
        gp._classes = real


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_next_group_plans_what_the_whole_block_policy_planned(data):
    g, old, step = _version(data)
    nrows = len(old.owner)
    # the pieces' sizes and counts as their rows make them, so cleaning is reached
    live = np.bincount(old.owner, minlength=len(old.pieces))
    rnb = data.draw(st.sampled_from([4, 68, 256]))
    for p, n in zip(old.pieces, live):
        p.count = int(n)
        p.nbytes = int(n) * (rnb + 2) + 36 + int(g.integers(0, 3)) * rnb * nrows // 40
    changed = np.sort(g.choice(nrows, size=data.draw(st.integers(1, nrows)), replace=False))
    a = _whole_block_next_group(old, changed, step, rnb)
    b = gp.next_group(old, changed, step, rnb)
    assert np.array_equal(a.rows, b.rows) and a.rows.dtype == b.rows.dtype
    assert len(a.new) == len(b.new)
    for (pa, sa, ta, ca), (pb, sb, tb, cb) in zip(a.new, b.new):
        assert (pa.cls, pa.step, pa.count, pa.nbytes, ta) == (pb.cls, pb.step, pb.count,
                                                             pb.nbytes, tb)
        assert np.array_equal(sa, sb) and np.array_equal(ca, cb)
    assert np.array_equal(a.group.owner, b.group.owner)
    assert np.array_equal(a.group.rq, b.group.rq)
    assert [(p.cls, p.step, p.nbytes) for p in a.group.pieces] == [
        (p.cls, p.step, p.nbytes) for p in b.group.pieces]

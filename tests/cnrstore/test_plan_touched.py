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

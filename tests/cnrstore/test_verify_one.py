"""One verification (issue 9): ``CheckpointStore.verify`` and ``cnrstore verify`` are the
same check (cnrstore/core/verify.py) returning records that name the step, table and block.
The tools' copy used to skip a block it had already decoded for another table, so a crafted
node listing a shared block with another geometry passed ``cnrstore verify``."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import random_table
from test_crafted_nodes import craft

import cnrstore
from cnrstore.core.verify import StepProblem
from cnrstore.tools import check


@pytest.fixture
def store(tmp_path):
    s = cnrstore.open(tmp_path / "ckpt", block_rows=8, fanout=4)
    s.put_tables(1, {"t": random_table(torch.Generator().manual_seed(0), 8, 4)})
    yield s
    s.close()


def test_a_crafted_geometry_over_a_shared_block_fails_both_verifies(store):
    craft(store, 1, 2, shape=(4, 4))
    for records in (store.verify().records, check.verify(store, deep=True).problems):
        assert records and all(isinstance(p, StepProblem) for p in records), records
        assert {(p.step, p.table, p.block) for p in records} == {(2, "t", 0)}
        assert all(p.oid for p in records)


def test_the_store_and_the_tool_report_the_same_problems(store):
    craft(store, 1, 2, dtype="Tensor")
    craft(store, 1, 3, shape=(4, 4))
    rep, res = store.verify(), check.verify(store, deep=True)
    assert not rep.ok and not res.ok
    assert rep.records == res.problems
    assert rep.problems == tuple(f"{p.what}: {p.message}" for p in res.problems)
    assert rep.steps_checked == res.steps_checked == 3
    shallow = check.verify(store, deep=False)
    assert shallow.blocks_decoded == 0 and store.verify(deep=False).blocks_checked == 0

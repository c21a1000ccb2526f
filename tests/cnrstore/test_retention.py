"""gc's retention rule (issue 8, item 2): one rule for the API and the CLI; a gc that
would drop every step by mistake is refused and drops nothing."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import assert_identical, make_store, random_table

import cnrstore
from cnrstore.core.retention import kept_steps
from cnrstore.tools import info as ci


@pytest.fixture(params=["memory", "pack"])
def store(request, tmp_path):
    s = make_store(request.param, tmp_path / "ckpt", block_rows=16, fanout=4)
    g = torch.Generator().manual_seed(1)
    s.tables = {}
    for step in (1, 2, 3):
        s.tables[step] = random_table(g, 40, 4)
        s.put_tables(step, {"t": s.tables[step]})
    yield s
    s.close()


def _intact(store):
    assert store.steps() == [1, 2, 3]
    for step, t in store.tables.items():
        assert_identical(store.get_tables(step)["t"], t)


@pytest.mark.parametrize("kwargs", [
    {"keep": [7]},                      # a typo of a step: once dropped every step
    {"keep_last": 0},                   # once dropped every step
    {"keep_last": 0, "keep": [1]},
    {"keep_last": 1, "keep": [99]},
    {"keep_last": -1},
    {"keep_last": 1.0},
    {"keep_last": True},
    {"keep": [-1]},
    {"keep": ["1"]},
])
def test_gc_refuses_a_rule_that_names_no_existing_step_and_drops_nothing(store, kwargs):
    with pytest.raises(cnrstore.InvalidInput):
        store.gc(**kwargs)
    _intact(store)
    with pytest.raises(cnrstore.InvalidInput):
        ci.gc_plan(store, **{"keep_last": None, **kwargs})
    _intact(store)


def test_gc_without_rule_drops_no_step(store):
    assert store.gc().steps_deleted == ()
    _intact(store)


def test_gc_keep_last_and_keep(store):
    rep = store.gc(keep_last=1, keep=[1])
    assert rep.steps_deleted == (2,) and rep.steps_kept == (1, 3)
    assert store.steps() == [1, 3]


def test_one_rule_function():
    assert kept_steps([1, 2, 3], keep_last=None) == [1, 2, 3]
    assert kept_steps([1, 2, 3], keep_last=2) == [2, 3]
    assert kept_steps([1, 2, 3], keep_last=5, keep=[1]) == [1, 2, 3]
    assert kept_steps([1, 2], keep_last=3) == [1, 2]
    assert kept_steps([1, 2, 3], keep_last=None, keep=[2]) == [2]
    assert ci.kept_steps is kept_steps
    for bad in ({"keep_last": 0}, {"keep_last": 1, "keep": [4]}):
        with pytest.raises(cnrstore.InvalidInput):
            kept_steps([1, 2, 3], **{"keep_last": None, **bad})

"""Restore reshards: a step saved by 2 ranks (row-wise, table-wise, replicated) reads
back exactly at world sizes 1 (no group), 3 and 4, each rank reading only its rows; and
the maintenance calls are collective (same result or error on every rank)."""

from __future__ import annotations

import pytest
import torch
from dist_util import BLOCK_ROWS, FANOUT, Failed, run
from dist_workers import _table, layouts, maintain, restore_layouts, save_layouts

import cnrstore


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "s"
    res = run(2, save_layouts, str(path))
    assert all(r is True for r in res), res
    return path


def test_one_process_without_a_group_reads_a_distributed_step(saved):
    with cnrstore.open(saved) as s:
        assert s.steps() == [1, 2]
        for step in (1, 2):
            got = s.get_tables(step)
            for name, t in layouts(step).items():
                assert torch.equal(got[name], t), name
        assert s.verify().ok


@pytest.mark.parametrize("world", [3, pytest.param(4, marks=pytest.mark.slow), 1])
def test_any_world_size_reads_its_rows(saved, world):
    for r, res in enumerate(run(world, restore_layouts, str(saved))):
        assert not isinstance(res, Failed), res.trace
        ok, whole = res
        assert whole and all(all(v) for v in ok.values()), (r, ok)


def test_maintenance_is_collective(tmp_path):
    res = run(2, maintain, str(tmp_path / "s"))
    for r in res:
        assert not isinstance(r, Failed), r.trace
    assert res[0] == res[1]
    out = res[0]
    assert out["steps"] == [1, 2, 3] and out["after_delete"] == [1, 3]
    assert out["delete_again"] == "StepNotFound" and out["rollback"] == [3]
    assert out["gc"] == ((1,), (4,)) and out["verify"] and out["stats"] == 1
    assert out["metadata"] == {"lr": 0.4} and out["rollback_missing"] == "StepNotFound"
    assert out["back"] and out["out_whole"] and out["lenient"]
    assert out["strict"] == "TableNotFound"
    with cnrstore.open(tmp_path / "o", block_rows=BLOCK_ROWS, fanout=FANOUT) as o:
        o.put_tables(1, {"t": _table(1)})
        assert o.put_tables(4, {"t": _table(4)}).tables == out["tables4"]


def test_a_group_needs_torch_distributed_initialized(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(cnrstore.InvalidInput, match="not initialized"):
        cnrstore.open(tmp_path / "s", group=object())
    assert not (tmp_path / "s").exists()

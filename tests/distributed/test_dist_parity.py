"""A DistributedStore does what a CheckpointStore does (cnrstore/core/api.py), on spawned
gloo ranks: a put_state's structure names every rank's leaves, ``progress=`` reports each
rank's own work, and a fresh Adam's empty state is restored bit for bit."""

from __future__ import annotations

import pytest
import torch
from dist_util import Failed, run
from parity_workers import leaves_of_one_rank, progress_per_rank


def test_a_leaf_only_another_rank_gives_is_in_the_stored_structure(tmp_path):
    res = run(2, leaves_of_one_rank, str(tmp_path / "s"))
    for r in res:
        assert not isinstance(r, Failed), r.trace
    for rank, r in enumerate(res):
        assert r["model"] == ["mine", "shared"], (rank, r)
        assert torch.equal(r["mine"], torch.arange(8.0).reshape(4, 2)), rank
        assert r["loader"] == {"pos": 17, "name": "r1"} and r["epoch"] == 3, (rank, r)
    # rank 0's state gets rank 1's dict as an empty one (leaves.uniform: one nesting on
    # every rank), left empty: rank 1 holds its entries, not every rank's empty one
    assert res[0]["back"] == (3, {}, None)
    assert res[1]["back"] == (3, {"pos": 17, "name": "r1"}, True)
    assert res[0]["clash"] == res[1]["clash"] and res[0]["clash"][0] == "InvalidInput", res
    assert "'x'" in res[0]["clash"][1], res[0]["clash"]
    assert res[0]["steps"] == res[1]["steps"] == [1]


def _check(calls: list) -> int:
    """Monotone, one total, exactly one final call and it is the last; its total."""
    assert calls, "no progress was reported"
    totals = {t for _, t in calls}
    assert len(totals) == 1, calls
    total = totals.pop()
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[0] >= 0, calls
    assert dones[-1] == total and dones.count(total) == 1, calls
    return total


@pytest.mark.parametrize("world", [2, 3])
def test_progress_reports_each_ranks_own_work(tmp_path, world):
    res = run(world, progress_per_rank, str(tmp_path / "s"), timeout=120)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    for rank, r in enumerate(res):
        own = r["own"]
        for call in ("put_tables", "put_state", "get_tables rows"):
            assert _check(r[call]) == own, (rank, call, r[call])
        for call in ("get_tables out", "load_state"):
            calls, restored = r[call]
            assert restored and _check(calls) == own, (rank, call)
        assert _check(r["get_state"]) == 256 * 8 * 4, rank
        for call in ("verify", "gc"):  # the coordinator's work, in thousandths
            if rank == 0:
                assert _check(r[call]) == 1000, (call, r[call])
            else:
                assert r[call] == [], (rank, call)
    assert sum(r["own"] for r in res) == 256 * 8 * 4
    bad = [r["bad"] for r in res]
    assert all(b == bad[0] for b in bad), bad
    assert all(e is not None and e[0] == "InvalidType" for e in bad[0]), bad[0]
    assert all(r["steps"] == [2] for r in res), [r["steps"] for r in res]


@pytest.mark.parametrize("world", [2, 3])
def test_a_fresh_adam_is_restored_bit_for_bit_and_trains_on_alike(tmp_path, world):
    from parity_workers import fresh_adam

    res = run(world, fresh_adam, str(tmp_path / "s"), timeout=120)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    assert all(r == {"restored": True, "stepped": True} for r in res), res


def test_a_fresh_adam_over_a_dtensor_parameter_is_restored_in_its_layout(tmp_path):
    # FSDP2's parameters are DTensors: the manager restores a fresh Adam's adopted state
    # as DTensors of the parameter's placements (whole plain tensors could not step).
    from parity_workers import dtensor_adam

    res = run(2, dtensor_adam, str(tmp_path / "s"), timeout=120)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    assert all(r == {"layout": True, "restored": True, "stepped": True} for r in res), res

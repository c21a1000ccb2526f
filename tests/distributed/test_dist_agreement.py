"""Ranks that do not agree (issue 23): calls made on only some ranks, a rank that never
opens the store, replicas that differ, input one rank cannot use. Each is the same clear
error on every rank, at once, before anything is written."""

from __future__ import annotations

import pytest
from agreement_workers import (
    checked_input,
    load_rounds,
    mismatched_calls,
    missing_rank_at_open,
)
from dist_util import Failed, run

import cnrstore


def test_ranks_in_different_calls_raise_collective_mismatch_at_once(tmp_path):
    res = run(2, mismatched_calls, str(tmp_path / "s"), timeout=60)
    for got in res:
        assert not isinstance(got, Failed), got.trace
    extra, *r0 = res[0]
    assert extra[0] == "CollectiveMismatch"
    assert "rank 0 in 'steps'" in extra[1] and "rank 1 in 'put_tables" in extra[1]
    assert r0[0] == extra or r0[0][0] == "RankFailed"  # unusable after the mismatch
    put1, after1, seconds1 = res[1][:3]
    assert put1 == extra                                # the same error on both ranks
    assert after1[0] == "RankFailed" and "open it again" in after1[1]
    for got in res:
        *_, seconds, other, seconds2, steps = got
        assert seconds < 5 and seconds2 < 5             # not the 20 s timeout
        assert other[0] == "CollectiveMismatch" and "'get_tables'" in other[1]
        assert "rank 1 in 'steps'" in other[1]
        assert steps == [1]
    assert res[0][-3] == res[1][-3]


def test_a_rank_that_never_opens_the_store_is_rank_failed(tmp_path):
    err, seconds = run(2, missing_rank_at_open, str(tmp_path / "s"), timeout=60)[0]
    assert err is not None and err[0] == "RankFailed", err
    assert "group=" in err[1] and seconds < 5
    assert issubclass(cnrstore.CollectiveMismatch, cnrstore.RankFailed)


def test_bad_input_on_a_rank_and_a_fresh_optimizer(tmp_path):
    res = run(2, checked_input, str(tmp_path / "s"), timeout=90)
    for got in res:
        assert not isinstance(got, Failed), got.trace
    for got in res:
        assert got["replica"][0] == "InvalidInput"
        assert "'dense'" in got["replica"][1] and "differ" in got["replica"][1]
        assert got["same replica"] is None
        for kind in ("deep put", "deep load"):
            assert got[kind][0] == "InvalidInput" and "deeper" in got[kind][1]
        for kind in ("out expand", "shard expand", "load expand"):
            assert got[kind][0] == "InvalidInput" and "share memory" in got[kind][1], kind
        for kind in ("out meta", "shard meta", "load meta"):
            assert got[kind][0] == "InvalidInput" and "meta" in got[kind][1], kind
        assert got["untouched"]
        assert got["resumed"] and got["epoch"] == 3
    assert res[0].pop("table-wise") == ["tw"] and res[1].pop("table-wise") == []
    assert res[0] == res[1]
    with cnrstore.open(tmp_path / "s") as s:
        assert s.steps() == [1, 2, 4, 5]
        assert s.get_tables(2)["dense"].eq(1).all()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_load_state_holds_an_adopt_round_only_where_a_state_holds_an_empty_container(
        tmp_path, world):
    """load_state's adopt round is left out where the structure round showed no empty
    container on any rank (nothing can be adopted: every rank knows it from that round);
    a rank whose state holds one (or that uniform leaves one) holds it on every rank, with
    the results as before. The TorchRec load's structure round carries the coordinator's
    stored shapes, and a state that differs is the same error on every rank, at once."""
    res = run(world, load_rounds, str(tmp_path / "s"), timeout=120)
    for got in res:
        assert not isinstance(got, Failed), got.trace
    for rank, got in enumerate(res):
        # structure, request, answer, closing: no adopt round
        assert got["uniform"] == (4, 0.1), got["uniform"]
        # + the adopt round and the read of what every rank adopts (3 rounds)
        assert got["fresh"] == (8, (["w"], [1.0, 1.0, 1.0])), got["fresh"]
        if world == 1:  # one rank alone adopts its own
            # strict=False asks which tables the step holds first: 2 rounds more
            assert got["last empty"] == (8, ["w"]) and got["made empty"][0] == 6
        else:
            assert got["last empty"] == (5, [] if rank == world - 1 else ["w"])
            assert got["made empty"][0] == 7
            assert got["made empty"][1] == ((["model", "optim"], ["w"]) if rank == 0 else
                                            (["model", "optim"], []))
        rounds, (shapes, no_empty, optim) = got["agreed"]
        assert rounds == 4 and no_empty and optim == ["model", "optim"]
        assert shapes == {"model/w": (4 * world, 2), "optim/state/w": (3,)}, shapes
        rounds, err = got["agreed, no step"]
        assert rounds == 1 and err[0] == "StepNotFound" and err[1].startswith("rank 0:")
        assert err == res[0]["agreed, no step"][1]
        if world > 1:
            rounds, err = got["agreed, not a mapping"]
            assert rounds == 1 and err[0] == "InvalidType" and "ranks [0] only" in err[1]
            rounds, err = got["agreed, another table"]
            assert rounds == 1 and err[0] == "InvalidInput" and "disagree" in err[1], err

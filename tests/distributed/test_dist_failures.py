"""All or nothing: bad input on one rank fails the put on every rank before anything is
written; a rank SIGKILLed at any point of the distributed commit fails it on every
survivor with RankFailed within the timeout, and no step appears (unless the coordinator
had committed it), earlier steps restore exactly, verify is clean, gc reclaims the rank
packs nobody adopted."""

from __future__ import annotations

import pytest
import torch
from dist_util import BLOCK_ROWS, FANOUT, Failed, run, survivors
from dist_workers import (
    _table,
    bad_input,
    deferred_failing,
    failing,
    hung,
    killed,
    late_failure,
)
from failure_workers import failed_then_tracked, small_steps

import cnrstore
from engine.packs.pack import list_pack_files


@pytest.mark.parametrize("how,error", [
    ("nan", "NonFiniteValues"), ("gap", "InvalidInput"),
    pytest.param("quant", "InvalidInput", marks=pytest.mark.slow),
    pytest.param("dtype", "InvalidInput", marks=pytest.mark.slow),
    pytest.param("type", "InvalidType", marks=pytest.mark.slow)])
def test_bad_input_on_one_rank_fails_the_put_everywhere(tmp_path, how, error):
    res = run(2, bad_input, str(tmp_path / "s"), how)
    with cnrstore.open(tmp_path / "oracle", block_rows=BLOCK_ROWS, fanout=FANOUT) as o:
        o.put_tables(1, {"t": _table(1)}, quant="int8")
        want = o.put_tables(3, {"t": _table(3)}, quant="int8").tables
    for r, got in enumerate(res):
        assert not isinstance(got, Failed), got.trace
        err, steps, tables, after = got
        assert err is not None and err[0] == error, (r, err)
        assert ("rank" in err[1] and "'t'" in err[1]) or how == "quant", err
        assert steps == [1] and after == [1, 3]
        assert tables == want
    assert res[0][0] == res[1][0]  # the same error on every rank


@pytest.mark.parametrize("where", ["pack", "plan"])
def test_a_rank_failing_after_the_last_agreed_round_fails_the_put_everywhere(tmp_path,
                                                                            where):
    # The rows a rank moves are announced in the check round; a rank that fails packing
    # them still sends what it announced, and its error (or one planning its runs) fails
    # the step on every rank in the writer's first round (an exact table's put takes no
    # width round): every rank's non-blocking put returns, and its Future fails.
    res = run(2, late_failure, str(tmp_path / "s"), where)
    for got in res:
        assert not isinstance(got, Failed), got.trace
    assert res[0] == res[1], res
    (kind, text), steps, returned = res[0]
    assert kind == "CheckpointError" and text.startswith("rank 1: MemoryError"), text
    assert steps == [1, 3] and returned


POINTS = [  # (victim, point, step committed)
    (1, "dist.rank_after_encode", False),
    (1, "sink.after_pack_write", False),
    (1, "dist.rank_before_seal", False),
    (1, "sink.after_seal", False),
    (1, "dist.rank_after_seal", False),
    (0, "dist.rank_after_seal", False),
    (0, "adopt.after_check", False),
    (0, "dist.coord_before_commit", False),
    (0, "writer.after_pack_write", False),
    (0, "writer.after_pack_fsync", True),    # its roots record is durable: rolled forward
    (0, "dist.coord_after_commit", True),
]


def _check_store(path, committed: bool) -> None:
    with cnrstore.open(path) as s:
        assert s.steps() == ([1, 2] if committed else [1])
        assert torch.equal(s.get_tables(1)["t"], _table(1))
        if committed:
            assert torch.equal(s.get_tables(2)["t"], _table(2))
        assert s.verify().ok
        s.gc(threshold=0.0)
        assert s.verify().ok
        # Every pack file left is one the index lists: the orphans are gone.
        assert len(list_pack_files(s.objects.path)) == s.objects.stats().packs


@pytest.mark.parametrize("victim,point,committed", [
    (1, "dist.rank_after_seal", False), (0, "dist.coord_before_commit", False)])
def test_a_killed_rank_fails_the_put_on_every_survivor(tmp_path, victim, point, committed):
    _killed(tmp_path, victim, point, committed)


@pytest.mark.slow
@pytest.mark.parametrize("victim,point,committed", POINTS)
def test_a_killed_rank_at_each_point_of_the_commit(tmp_path, victim, point, committed):
    _killed(tmp_path, victim, point, committed)


def _killed(tmp_path, victim, point, committed):
    path = tmp_path / "s"
    res = run(2, killed, str(path), victim, point, timeout=90, expect_dead=(victim,))
    for _err, seconds, closing, closed in survivors(res, victim):
        assert seconds < 15 + 10 and closing < 5, (seconds, closing)
        assert closed == "store is closed"
    _check_store(path, committed)


def test_a_hung_rank_is_detected_by_the_timeout(tmp_path):
    res = run(2, hung, str(tmp_path / "s"), 1, timeout=60)
    assert res[1] == "slept"
    err, seconds = res[0]
    assert err == "RankFailed" and 1.5 < seconds < 6, res[0]
    with cnrstore.open(tmp_path / "s") as s:
        assert s.steps() == [1]


@pytest.mark.parametrize("victim,point", [
    (1, "dist.rank_before_seal"),
    pytest.param(0, "dist.coord_before_commit", marks=pytest.mark.slow)])
def test_a_write_failing_on_one_rank_fails_the_step_everywhere(tmp_path, victim, point):
    res = run(2, failing, str(tmp_path / "s"), victim, point)
    with cnrstore.open(tmp_path / "o", block_rows=BLOCK_ROWS, fanout=FANOUT) as o:
        o.put_tables(1, {"t": _table(1)})
        want = o.put_tables(3, {"t": _table(3)}).tables
    for r in res:
        assert not isinstance(r, Failed), r.trace
        err, steps, tables, ok = r
        assert err[0] == "WriteFailed" and "No space left" in err[1], err
        assert steps == [1, 3] and tables == want and ok
    assert res[0][0] == res[1][0]
    with cnrstore.open(tmp_path / "s") as s:
        s.gc(threshold=0.0)
        assert len(list_pack_files(s.objects.path)) == s.objects.stats().packs


def test_a_deferred_plan_failing_on_one_rank_fails_the_step_everywhere(tmp_path):
    # A non-blocking tracker-driven put is planned on the writer thread (core/snapshot.py):
    # rank 1's writer fails after planning one of its two runs, before the first round,
    # so every rank's Future fails with its error, nothing is stored, and the next put
    # stores its step.
    res = run(2, deferred_failing, str(tmp_path / "s"), 1)
    for r in res:
        assert not isinstance(r, Failed), r.trace
        err, steps, same, ok = r
        assert err[0] == "WriteFailed" and "No space left" in err[1], err
        assert "dist.rank_after_plan" in err[1]
        assert steps == [1, 3] and same and ok
    assert res[0][0] == res[1][0]


@pytest.mark.parametrize("quant,delta,victim,point", [
    ("int8", 1e-3, 1, "dist.rank_before_seal"),
    ("exact", 1.0, 1, "dist.rank_after_plan"),   # a deferred plan, never made
    pytest.param("int8", 1e-3, 0, "dist.coord_before_commit", marks=pytest.mark.slow)])
def test_the_puts_after_a_failed_step_store_the_ids_of_a_job_that_never_tried_it(
        tmp_path, quant, delta, victim, point):
    # A failed put is as if never tried: every rank diffs the next tracker-driven put
    # against the bases the last committed put left (docs/ARCHITECTURE.md, "Determinism"),
    # so its ids are those of a single process that put the other steps alone, its
    # touched rows covering every change since its last put.
    res = run(2, failed_then_tracked, str(tmp_path / "s"), quant, delta, point, victim)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    steps = small_steps(delta)
    want = {}
    with cnrstore.open(tmp_path / "o", block_rows=BLOCK_ROWS, fanout=FANOUT) as o:
        want[0] = o.put_tables(0, {"t": steps[0][0]}, quant=quant).tables
        since = []
        for step, (t, touched) in enumerate(steps[1:], start=1):
            since.append(touched)
            if step != 2:
                want[step] = o.put_tables(step, {"t": t}, quant=quant,
                                          touched={"t": torch.cat(since)}).tables
                since = []
    for ids, same, ok in res:
        assert ids.pop(2) == "WriteFailed"
        assert ids == want and ok and same in (None, True)

"""The put pipeline (cnrstore/core/put.py) and the get pipeline (cnrstore/core/get.py)
are one each (docs/design/one-pipeline.md): the single-process handle and the
distributed handle run the same pipeline functions with different named strategies,
and the world of one (core/group.py ``Solo``) answers every round as the gloo
implementation does on one rank, so the steps, and the gets, are the same."""

from __future__ import annotations

from dist_util import Failed, run
from seam_workers import (
    get_functions,
    gets_alike,
    pipeline_functions,
    plain_get_functions,
    plain_pipeline_functions,
    world_of_one,
)


def test_the_world_of_one_answers_as_gloo_and_writes_the_same_steps(tmp_path):
    (res,) = run(1, world_of_one, str(tmp_path / "d"), str(tmp_path / "p"), timeout=300)
    assert not isinstance(res, Failed), res.trace
    gloo, solo = res["seams"]["gloo"], res["seams"]["solo"]
    assert gloo == solo, (gloo, solo)
    assert solo[2] == ("err", "InvalidInput") and solo[5] == ("err", "StepNotFound")
    dist, plain = res["distributed"], res["plain"]
    assert len(dist) == len(plain) == 3
    for step, (d, p) in enumerate(zip(dist, plain), 1):
        # the same table nodes (so the same blocks, segments and codes), the same counts
        assert d["tables"] == p["tables"], step
        assert d["rows_changed"] == p["rows_changed"], step
        assert d["rows_written"] == p["rows_written"], step
        assert d["data"] == p["data"], step
    assert plain[1]["rows_changed"]["emb"] == 14 and plain[2]["rows_changed"]["emb"] == 21


def test_both_handles_run_the_same_pipeline_functions(tmp_path):
    res = run(2, pipeline_functions, str(tmp_path / "d"), timeout=300)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    plain = plain_pipeline_functions(str(tmp_path / "p"))
    assert plain["strategies"] == ["Solo", "WholeTables", "EngineCommit", "OwnStore"]
    for r in res:
        assert r["strategies"] == ["Comm", "RowGrid", "CoordinatorCommit", "RankBlocks"]
    stages = {"put", "_plan_all", "_plan", "_agree_widths", "_queued", "queued",
              "_release", "forget_failed", "marking_failed"}
    assert stages <= set(plain["functions"]), plain["functions"]
    # the coordinator checks the step against the store, as a world of one does
    assert set(res[0]["functions"]) == set(plain["functions"]), (res[0], plain)
    assert set(res[1]["functions"]) == set(plain["functions"]) - {"check_new_step"}, res[1]


def test_a_one_rank_distributed_store_gets_what_a_plain_store_gets(tmp_path):
    (res,) = run(1, gets_alike, str(tmp_path / "d"), str(tmp_path / "p"), timeout=300)
    assert not isinstance(res, Failed), res.trace
    dist, plain = res["distributed"], res["plain"]
    assert len(dist) == len(plain) == 20
    for i, (d, p) in enumerate(zip(dist, plain)):
        assert d == p, (i, d if d[0] == "err" else "ok", p if p[0] == "err" else "ok")
    assert [o[0] for o in plain[:6]] == ["ok"] * 5 + ["err"]
    assert plain[6:13] == [("err", "StepNotFound"), ("err", "TableNotFound"),
                           ("err", "TableNotFound"), ("err", "InvalidInput"),
                           ("err", "InvalidType"), ("err", "InvalidInput"),
                           ("err", "InvalidInput")]
    assert plain[16] == ("err", "InvalidInput") and plain[18] == ("err", "InvalidInput")


def test_both_handles_run_the_same_get_functions(tmp_path):
    res = run(2, get_functions, str(tmp_path / "d"), timeout=300)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    plain = plain_get_functions(str(tmp_path / "p"))
    assert plain["strategies"][3] == "OwnStore"
    assert all(r["strategies"][3] == "RankBlocks" for r in res)
    stages = {"get", "resolve", "answer", "_ranges", "reporter", "out_bytes", "read_rows"}
    assert stages <= set(plain["functions"]), plain["functions"]
    # CheckpointStore's entry (get_tables) is its own; the coordinator answers every
    # rank, as a world of one answers itself; the other rank runs the rest.
    assert set(res[0]["functions"]) == set(plain["functions"]) - {"get_tables"}, (
        res[0], plain)

    def named(fs: list[str]) -> set[str]:  # not the comprehensions
        return {f for f in fs if not f.startswith("<")}

    assert named(res[1]["functions"]) == named(res[0]["functions"]) - {
        "answer", "names", "_ranges", "share"}, res[1]

"""The put pipeline is one (cnrstore/core/put.py; docs/design/one-pipeline.md): the
single-process handle and the distributed handle run the same pipeline functions with
different named strategies, and the world of one (core/group.py ``Solo``) answers every
round as the gloo implementation does on one rank, so the steps are the same."""

from __future__ import annotations

from dist_util import Failed, run
from seam_workers import pipeline_functions, plain_pipeline_functions, world_of_one


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
    assert plain["strategies"] == ["Solo", "WholeTables", "EngineCommit"]
    for r in res:
        assert r["strategies"] == ["Comm", "RowGrid", "CoordinatorCommit"]
    stages = {"put", "_plan_all", "_plan", "_agree_widths", "_queued", "queued",
              "_release", "forget_failed", "marking_failed"}
    assert stages <= set(plain["functions"]), plain["functions"]
    # the coordinator checks the step against the store, as a world of one does
    assert set(res[0]["functions"]) == set(plain["functions"]), (res[0], plain)
    assert set(res[1]["functions"]) == set(plain["functions"]) - {"check_new_step"}, res[1]

"""Any TorchRec plan: tables TorchRec's own planner shards column-wise and table-column-wise
(and table-wise, row-wise, data-parallel) saved at 2 ranks with their fused row-wise
Adagrad state and touched rows from TorchRec's ModelDeltaTracker, restored exactly under
the same plan and under another plan at 3 ranks; a column-wise table stores the same
objects as the same table row-wise. The matrix of every type is test_torchrec_matrix.py."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import torch  # noqa: E402
import trplans  # noqa: E402
import trspawn  # noqa: E402

TIMEOUT = 300


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    paths = [str(d / n) for n in ("a", "b", "cw", "rw")]
    got = trspawn.run(trplans.save_worker, 2, *paths, timeout=TIMEOUT)
    return paths[0], got


def test_planner_plans_column_wise_and_the_same_plan_restores_exactly(saved):
    _, got = saved
    plan = got[0]["plan"]
    # the planner, forced by constraints, chose these types itself (not a hand-made plan)
    assert plan == {"t0": "table_wise", "t1": "row_wise", "t2": "table_wise",
                    "t3": "column_wise", "t4": "table_column_wise", "t5": "table_wise",
                    "t6": "data_parallel"}, plan
    saved_w = trplans.assemble([g["saved"] for g in got])
    # t3 is in column pieces, and so is its row-wise Adagrad accumulator (one per piece)
    pieces = [p for g in got for p in g["saved"]["ebc/model/sparse.embedding_bags.t3.weight"][1]]
    assert len({c for _, c, _ in pieces}) > 1
    mom = "ebc/optim/state/sparse.embedding_bags.t3.weight/t3.momentum1"
    assert saved_w[mom].shape[0] == 16 * len({c for _, c, _ in pieces})
    trplans.check_equal(trplans.assemble([g["again"] for g in got]), saved_w)
    # and the restored job's next step is the saved job's, bit for bit
    trplans.check_equal(trplans.assemble([g["after_same"] for g in got]),
                        trplans.assemble([g["after"] for g in got]))


def test_a_table_stores_the_same_objects_column_wise_and_row_wise(saved):
    _, got = saved
    assert got[0]["rw_plan"]["t3"] == "row_wise" and got[0]["rw_plan"]["t4"] == "row_wise"
    cw, rw = got[0]["ids"]
    assert cw == rw  # every table node, so every block: the plan is not in the ids


def test_touched_rows_from_torchrecs_tracker_on_column_pieces(saved):
    _, got = saved
    ta, tb, na, nb = got[0]["tracked"]
    assert ta == tb  # the tracker-driven put stores the same tables, node for node
    assert 0 < na <= nb


def test_column_wise_restores_under_another_plan_at_three_ranks(saved):
    path, got = saved
    before = trplans.assemble([g["saved"] for g in got])
    res = trspawn.run(trplans.load_worker, 3, path, trplans.LOAD3, True, timeout=TIMEOUT)
    plan = res[0][0]
    assert plan["t3"] == "row_wise" and plan["t5"] == "column_wise" and plan["t0"] == (
        "column_wise")
    loaded = trplans.assemble([r[1] for r in res])
    weights = [p for p in before if "/model/" in p]
    trplans.check_equal(loaded, before, weights)
    # optimizer state: exact where the plan keeps one entry per row; a per-piece
    # accumulator is mapped through the row's mean (t3: cw -> rw, t5: tw -> cw)
    want = trplans.expected_optim({p: v for p, v in before.items() if "/optim/" in p} | {
        p: before[p] for p in weights}, {p: tuple(v.shape) for p, v in loaded.items()})
    optim = [p for p in before if "/optim/" in p]
    assert any(loaded[p].shape != before[p].shape for p in optim)
    for p in optim:
        torch.testing.assert_close(loaded[p], want[p], rtol=1e-6, atol=0)

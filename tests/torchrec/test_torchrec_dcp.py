"""A TorchRec DMP through DCP into cnrstore (cnrstore.dcp): ``dcp.save(dmp.state_dict(),
storage_writer=StorageWriter(...))`` of plans TorchRec's planner picks, column-wise ones
included, in ShardedTensor and DTensor output modes at 2 ranks; ``dcp.load`` into a DMP of
another plan at 3 ranks gives back every table exactly. Slow (two spawns of TorchRec); the
default suite saves a DTensor cut along columns through DCP (tests/dcp/test_dcp_ranks.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import trplans  # noqa: E402
import trspawn  # noqa: E402


@pytest.mark.slow
def test_dmp_round_trips_through_dcp_into_another_plan_and_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = trspawn.run(trplans.dcp_worker, 2, path,
                        [(1, trplans.DCP_ST, False), (2, trplans.DCP_DT, True)], [],
                        timeout=300)
    # step 1 (ShardedTensor mode, column-wise) into DTensor mode under a row-wise plan;
    # step 2 (DTensor mode) into ShardedTensor mode with other column pieces
    loads = [(1, {"ebc": {"t3": "rw", "t4": "rw", "t5": "cw", "t0": "cw", "t1": "tw",
                          "t2": "rw", "t6": "tw"}}, True),
             (2, {"ebc": {"t3": "tw", "t4": "rw", "t5": "twcw", "t0": "cw", "t1": "twcw",
                          "t2": "tw", "t6": "rw"}}, False)]
    got = trspawn.run(trplans.dcp_worker, 3, path, [], loads, timeout=300)
    for step in (1, 2):
        plan = got[0][step][0]
        want = trplans.assemble([r[step] for r in saved])
        trplans.check_equal(trplans.assemble([r[step][1] for r in got]), want)
        assert set(plan.values()) & {"column_wise", "table_column_wise"}, plan
    assert got[0][1][0]["t3"] == "row_wise" and got[0][2][0]["t1"] == "table_column_wise"

"""A DistributedStore does what a CheckpointStore does (cnrstore/core/api.py), on spawned
gloo ranks: a put_state's structure names every rank's leaves."""

from __future__ import annotations

import torch
from dist_util import Failed, run
from parity_workers import leaves_of_one_rank


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

"""Every sharding type TorchRec offers (table-wise, row-wise, table-row-wise, column-wise,
table-column-wise, grid, data-parallel), for EmbeddingBagCollection (row-wise Adagrad, and
SGD) and EmbeddingCollection (full Adagrad), under plans TorchRec's planner picks: saved at
4 ranks (2 hosts of 2), restored at 3, 2 and 1 ranks with every table under another type."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import torch  # noqa: E402
import trplans  # noqa: E402
import trspawn  # noqa: E402

TIMEOUT = 420
TYPES = {"table_wise", "row_wise", "table_row_wise", "column_wise", "table_column_wise",
         "grid_shard", "data_parallel"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("matrix") / "store")
    got = trspawn.run(trplans.matrix_save, 4, path, 2, timeout=TIMEOUT)
    return path, got[0][0], trplans.assemble([g[1] for g in got])


@pytest.mark.slow
@pytest.mark.parametrize("world,local,by,dtensor", [(3, 3, 1, False), (2, 1, 3, False),
                                                    (1, 1, 2, True)])
def test_every_type_restores_under_another_at_another_world_size(saved, world, local, by,
                                                                 dtensor):
    path, plan, before = saved
    assert set(plan["ebc"].values()) == TYPES  # the planner gave each type asked for
    got = trspawn.run(trplans.matrix_load, world, path, local, by, dtensor, timeout=TIMEOUT)
    new_plan = got[0][0]
    assert all(new_plan["ebc"][t] != plan["ebc"][t] for t in plan["ebc"]), new_plan
    loaded = trplans.assemble([g[1] for g in got])
    weights = [p for p in before if "/optim/" not in p]
    trplans.check_equal(loaded, before, weights)
    optim = [p for p in before if "/optim/" in p and p in loaded]
    want = trplans.expected_optim({p: before[p] for p in optim + weights},
                                  {p: tuple(loaded[p].shape) for p in optim + weights})
    for p in optim:
        torch.testing.assert_close(loaded[p], want[p], rtol=1e-6, atol=0)
    # the EC's full Adagrad state is 2-D, joined like its table: exact under any plan
    ec = [p for p in optim if p.startswith("ec/")]
    assert ec and all(torch.equal(loaded[p], before[p]) for p in ec)

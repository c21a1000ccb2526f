"""shard_leaf/fill_leaf on TorchRec's own state: DistributedModelParallel's state_dict and
fused optimizer state under table-wise, row-wise and table-row-wise plans, in ShardedTensor
and DTensor output mode (where the placements do not describe the layout)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import torch  # noqa: E402
import trmodels  # noqa: E402
import trspawn  # noqa: E402
from trcheck import check_tiling, describe, table  # noqa: E402

from cnrstore.distributed.leaves import fill_leaf, shard_leaf  # noqa: E402
from cnrstore.errors import InvalidInput  # noqa: E402

TIMEOUT = 180
LAYOUTS = {"ebc": {"t0": "tw:1", "t1": "rw", "t2": "twrw"},
           "ec": {"t0": "tw:1", "t1": "rw", "t2": "tw:0"}}  # EC has no table-row-wise


def _leaves(m):
    leaves = {f"model/{k}": v for k, v in m.state_dict().items() if k != "scale"}
    for fqn, st in m.fused_optimizer.state_dict()["state"].items():
        for k, v in st.items():
            leaves[f"optim/{fqn}/{k}"] = v
    return leaves


def _worker(rank, world):
    import torch.distributed as dist
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = {}
    # one spawn for both output modes: importing TorchRec costs more than the models
    for dtensor, kind, optim in ((False, "ebc", "rowwise"), (True, "ebc", "rowwise"),
                                 (False, "ec", "full_adagrad"), (True, "ec", "full_adagrad")):
        m = trmodels.dmp(kind, LAYOUTS[kind], world, dtensor=dtensor, optim=optim)
        leaves = _leaves(m)
        for name, v in leaves.items():
            other = table("x" + name, tuple(v.shape))
            fill_leaf(v, lambda lo, hi, o=other: o[lo:hi])
        # state_dict() again: the fill went into the kernels' own storage
        for name, v in _leaves(m).items():
            out[(dtensor, kind, name, tuple(v.shape))] = describe(shard_leaf(v))
        # and the model looks up the filled rows: feature fi, sample j -> row ids[j]
        ids = torch.tensor([0, 8, 9, 10])
        kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.cat([ids] * 3),
                                lengths=torch.ones(12, dtype=torch.int64))
        res = m(kjt)
        for i, n in enumerate((20, 18, 11)):
            d = 8 if kind == "ebc" and i == 2 else 4
            coll = "embedding_bags" if kind == "ebc" else "embeddings"
            want = table(f"xmodel/sparse.{coll}"
                         f".t{i}.weight", (n, d))[ids]
            got = res.to_dict()[f"f{i}"] if kind == "ebc" else res[f"f{i}"].values()
            torch.testing.assert_close(got, want)
    # column-wise: a clear refusal, naming the way out
    for dtensor in (False, True):
        m = trmodels.dmp("ebc", {"t0": "cw", "t1": "rw", "t2": "rw"}, world, dtensor=dtensor,
                         dims=(64, 4, 4))
        with pytest.raises(InvalidInput, match="columns"):
            shard_leaf(m.state_dict()["sparse.embedding_bags.t0.weight"])
    dist.barrier()
    return out


@pytest.mark.slow  # the default suite covers both modes through test_torchrec_state.py
def test_torchrec_state_rows():
    per_rank = trspawn.run(_worker, 2, timeout=TIMEOUT)
    names = set().union(*per_rank)
    # every leaf named on every rank that holds it; those only some ranks hold (the fused
    # optimizer state of a table-wise table) are tiled by those ranks alone
    assert {k[2] for k in names if k[:2] == (True, "ebc")} >= {
        "model/sparse.embedding_bags.t0.weight",
        "optim/sparse.embedding_bags.t2.weight/t2.momentum1"}
    for key in names:
        _, kind, name, gshape = key
        check_tiling([r[key] for r in per_rank if key in r], gshape, "x" + name)
    # row-wise Adagrad's per-row state is 1-D and sharded like its table
    for dtensor in (False, True):
        mom = (dtensor, "ebc", "optim/sparse.embedding_bags.t1.weight/t1.momentum1", (18,))
        assert [s[0] for r in per_rank for s in r[mom]] == [0, 9]
    assert len({k[0] for k in names}) == 2 and len({k[1] for k in names}) == 2

"""Small TorchRec models sharded by explicit plans on CPU/gloo, for the tests."""

from __future__ import annotations

import torch


def tables(kind: str = "ebc", rows=(20, 18, 11), dims=None):
    import torchrec

    # an EmbeddingCollection needs one embedding dim for all its tables
    dims = dims or ((4, 4, 8) if kind == "ebc" else (4,) * len(rows))
    cls = torchrec.EmbeddingBagConfig if kind == "ebc" else torchrec.EmbeddingConfig
    return [cls(name=f"t{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f{i}"])
            for i, (n, d) in enumerate(zip(rows, dims))]


def module(kind: str = "ebc", **kw):
    import torchrec

    cfg = tables(kind, **kw)
    if kind == "ebc":
        return torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device("meta"))
    return torchrec.EmbeddingCollection(tables=cfg, device=torch.device("meta"))


def plan_for(m, layout: dict, world: int):
    """layout: table name -> "tw:<rank>" | "rw" | "twrw" | "cw"."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    gens = {}
    for name, how in layout.items():
        if how.startswith("tw:"):
            gens[name] = sp.table_wise(rank=int(how.split(":")[1]))
        elif how == "rw":
            gens[name] = sp.row_wise()
        elif how == "twrw":
            gens[name] = sp.table_row_wise(host_index=0)
        elif how == "cw":
            gens[name] = sp.column_wise(ranks=list(range(world)))
        else:
            raise ValueError(how)
    mp = sp.construct_module_sharding_plan(m, gens, local_size=world, world_size=world,
                                           device_type="cpu")
    return ShardingPlan({"": mp})


def dmp(kind: str, layout: dict, world: int, *, dtensor: bool = False, optim: str = "rowwise",
        seed: int = 0, **kw):
    """A DistributedModelParallel over a bare EBC/EC with a fused optimizer (row-wise or
    full Adagrad), weights initialised from ``seed`` identically on every rank."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(seed)
    m = module(kind, **kw)
    if optim == "rowwise":
        apply_optimizer_in_backward(RowWiseAdagrad, m.parameters(), {"lr": 0.1})
    elif optim == "full_adagrad":  # FBGEMM's CPU kernels have no Adam; this state is 2-D
        apply_optimizer_in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.05})
    env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD, output_dtensor=dtensor)
    return DistributedModelParallel(m, env=env, device=torch.device("cpu"),
                                    plan=plan_for(m, layout, world))


def batch(kind: str, seed: int, batch_size: int = 8, rows=(20, 18, 11)):
    """A KeyedJaggedTensor of random ids for every feature (the same on every rank when the
    seed is)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(rows) * batch_size,), generator=g)
    vals = []
    for i, n in enumerate(rows):
        k = int(lengths[i * batch_size:(i + 1) * batch_size].sum())
        vals.append(torch.randint(0, n, (k,), generator=g))
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(len(rows))],
                             values=torch.cat(vals), lengths=lengths)


def train_step(model, kind: str, kjt):
    out = model(kjt)
    if kind == "ebc":
        loss = sum(v.sum() for v in out.to_dict().values())
    else:
        loss = sum(v.values().sum() for v in out.values())
    loss.backward()
    return float(loss)

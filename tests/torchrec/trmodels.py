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


def module(kind: str = "ebc", device: str = "meta", **kw):
    import torchrec

    cfg = tables(kind, **kw)
    if kind == "ebc":
        return torchrec.EmbeddingBagCollection(tables=cfg, device=torch.device(device))
    return torchrec.EmbeddingCollection(tables=cfg, device=torch.device(device))


class Sparse(torch.nn.Module):
    """The collection under a parent module, as in a real model: state_dict keys read
    ``sparse.embedding_bags.t0.weight`` and TorchRec's delta tracker finds it there."""

    def __init__(self, coll):
        super().__init__()
        self.sparse = coll
        # a dense parameter: DMP wraps the dense part in DDP, as in any real model (and
        # the tracker expects that wrapper); replicated on every rank
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, kjt):
        return self.sparse(kjt)


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
    mp = sp.construct_module_sharding_plan(m.sparse, gens, local_size=world, world_size=world,
                                           device_type="cpu")
    return ShardingPlan({"sparse": mp})


TYPES = {"tw": "table_wise", "rw": "row_wise", "twrw": "table_row_wise", "cw": "column_wise",
         "twcw": "table_column_wise", "grid": "grid_shard", "dp": "data_parallel"}


def _sharder(kind: str):
    """TorchRec's own sharder for the collection, offering every sharding type on CPU.
    TorchRec's CPU list (embedding_types.py, sharding_types) leaves out row-wise,
    table-row-wise and grid, which its CPU kernels run (the hand-made plans of the other
    tests use them); the planner then plans them as it would on GPUs."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    base = EmbeddingBagCollectionSharder if kind == "ebc" else EmbeddingCollectionSharder

    class AnyTypeSharder(base):  # type: ignore[valid-type, misc]
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return super().sharding_types("cuda")

    return AnyTypeSharder()


def planned(m, kind: str, types: dict, world: int, local: int | None = None):
    """The plan TorchRec's EmbeddingShardingPlanner picks with ParameterConstraints forcing
    table name -> sharding type ("cw", "grid", ...; fused kernel, column pieces of at
    least 4 columns), on a CPU topology of ``world`` ranks, ``local`` per host."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    cons = {name: ParameterConstraints(
        sharding_types=[TYPES[how]], min_partition=4,
        compute_kernels=["dense" if how == "dp" else "fused"]) for name, how in types.items()}
    topo = Topology(world_size=world, local_world_size=local or world, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology=topo, constraints=cons, debug=False)
    import torch.distributed as dist

    if dist.is_initialized():
        return planner.collective_plan(m, [_sharder(kind)], dist.group.WORLD)
    return planner.plan(m, [_sharder(kind)])


def dmp(kind: str, layout: dict, world: int, *, dtensor: bool = False, optim: str = "rowwise",
        seed: int = 0, plan: str = "hand", local: int | None = None, **kw):
    """A DistributedModelParallel over a bare EBC/EC with a fused optimizer (row-wise or
    full Adagrad, or SGD), weights initialised from ``seed`` identically on every rank.
    ``plan="planner"``: TorchRec's planner picks it (``planned``; layout: name -> type)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(seed)
    m = Sparse(module(kind, **kw))
    if optim == "rowwise":
        apply_optimizer_in_backward(RowWiseAdagrad, m.sparse.parameters(), {"lr": 0.1})
    elif optim == "full_adagrad":  # FBGEMM's CPU kernels have no Adam; this state is 2-D
        apply_optimizer_in_backward(torch.optim.Adagrad, m.sparse.parameters(), {"lr": 0.05})
    elif optim == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, m.sparse.parameters(), {"lr": 0.1})
    env = ShardingEnv(world, dist.get_rank(), dist.group.WORLD, output_dtensor=dtensor)
    if plan == "planner":
        return DistributedModelParallel(m, env=env, device=torch.device("cpu"),
                                        plan=planned(m, kind, layout, world, local),
                                        sharders=[_sharder(kind)])
    return DistributedModelParallel(m, env=env, device=torch.device("cpu"),
                                    plan=plan_for(m, layout, world))


def batch(kind: str, seed: int, batch_size: int = 12, rows=(20, 18, 11), rank: int = 0,
          world: int = 1):
    """Rank ``rank``'s part of a global batch of ``batch_size`` samples of random ids (the
    global batch depends on the seed only, so any world size trains on the same samples)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(seed)
    lo, hi = rank * batch_size // world, (rank + 1) * batch_size // world
    lengths, values = [], []
    for n in rows:
        ln = torch.randint(0, 3, (batch_size,), generator=g)
        ids = torch.randint(0, n, (int(ln.sum()),), generator=g)
        start = torch.cat([torch.zeros(1, dtype=torch.int64), ln.cumsum(0)])
        lengths.append(ln[lo:hi])
        values.append(ids[int(start[lo]):int(start[hi])])
    return KeyedJaggedTensor(keys=[f"f{i}" for i in range(len(rows))],
                             values=torch.cat(values), lengths=torch.cat(lengths))


def train_step(model, kind: str, kjt):
    out = model(kjt)
    if kind == "ebc":
        loss = sum(v.sum() for v in out.to_dict().values())
    else:
        loss = sum(v.values().sum() for v in out.values())
    loss = loss * model.module.scale if hasattr(model, "module") else loss
    # TorchRec divides embedding gradients by the world size (as DDP averages): scaled back,
    # a row's gradient is its lookup count, exactly, at any world size
    import torch.distributed as dist

    loss = loss * (dist.get_world_size() if dist.is_initialized() else 1)
    loss.backward()
    return float(loss)

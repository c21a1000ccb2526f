"""Rank programs of the DCP backend's tests (module-level: spawned ranks import them by
name). Every program runs DCP's own save and load with cnrstore's StorageWriter and
StorageReader over real gloo groups."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import cnrstore
from cnrstore.dcp import StorageReader, StorageWriter

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

ROWS, DIM = 300, 8


def full(step: int) -> dict[str, torch.Tensor]:
    """The global tensors of a save at ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(step)
    return {"emb": torch.randn(ROWS, DIM, generator=g), "bias": torch.randn(DIM, generator=g),
            "acc": torch.rand(ROWS, generator=g)}


def cut(rows: int, rank: int, world: int) -> tuple[int, int]:
    # Uneven on purpose: shards never align with the store's block grid.
    edges = [0, *[rows * (2 * i + 1) // (2 * world + 1) for i in range(1, world)], rows]
    return edges[rank], edges[rank + 1]


def sharded_tensor(t: torch.Tensor, rank: int, world: int):
    """A ShardedTensor of ``t`` cut along rows as ``cut`` says."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import (
        init_from_local_shards,
    )

    lo, hi = cut(t.shape[0], rank, world)
    md = ShardMetadata(shard_offsets=[lo, *[0] * (t.ndim - 1)],
                       shard_sizes=[hi - lo, *t.shape[1:]], placement=f"rank:{rank}/cpu")
    return init_from_local_shards([STShard(t[lo:hi].clone(), md)], *t.shape)


def state(kind: str, step: int, rank: int, world: int) -> dict:
    """The state a rank saves (or loads into, zeroed) as ``kind``: "dtensor" (rows
    sharded over the world, the bias replicated), "dtensor_col" (cut along columns),
    "sharded" (ShardedTensor rows), "plain" (whole tensors on every rank)."""
    t = full(step)
    out: dict = {"epoch": step, "note": f"step {step}", "optim": {"lr": 0.01 * step,
                                                                  "step": torch.tensor(step)}}
    if kind == "plain":
        model = {"emb": t["emb"].clone(), "bias": t["bias"].clone()}
        out["optim"]["acc"] = t["acc"].clone()
    elif kind == "sharded":
        model = {"emb": sharded_tensor(t["emb"], rank, world), "bias": t["bias"].clone()}
        out["optim"]["acc"] = sharded_tensor(t["acc"], rank, world)
    else:
        mesh = init_device_mesh("cpu", (world,))
        place = [Shard(1)] if kind == "dtensor_col" else [Shard(0)]
        model = {"emb": distribute_tensor(t["emb"], mesh, place),
                 "bias": distribute_tensor(t["bias"], mesh, [Replicate()])}
        out["optim"]["acc"] = distribute_tensor(t["acc"], mesh, [Shard(0)])
    out["model"] = model
    return out


def zeroed(s: dict) -> dict:
    """``s`` with every tensor zero and every Python value blank (a target to load into)."""
    out: dict = {}
    for k, v in s.items():
        if isinstance(v, dict):
            out[k] = zeroed(v)
        elif isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh,
                                        v.placements, shape=v.shape, stride=v.stride())
        elif isinstance(v, torch.Tensor) and hasattr(v, "local_shards"):
            for sh in v.local_shards():
                sh.tensor.zero_()
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = type(v)()
    return out


def gathered(s: dict) -> dict:
    """Every tensor of ``s`` as the whole global tensor (collective for DTensors; a
    ShardedTensor is gathered onto rank 0 only and its other ranks give None)."""
    out: dict = {}
    for k, v in s.items():
        if isinstance(v, dict):
            out[k] = gathered(v)
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor()
        elif isinstance(v, torch.Tensor) and hasattr(v, "local_shards"):
            dest = torch.zeros(v.shape) if dist.get_rank() == 0 else None
            v.gather(0, dest)
            out[k] = dest
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def save(rank: int, world: int, path: str, kind: str, steps: list[int]) -> list:
    """dcp.save of ``state(kind, step)`` for each step into ``path``; each rank's StepInfo
    as (bytes written, rows changed, table ids)."""
    infos = []
    for step in steps:
        w = StorageWriter(path, step=step, block_rows=32)
        dcp.save(state(kind, step, rank, world), storage_writer=w)
        infos.append((w.info.bytes_written, dict(w.info.rows_changed), w.info.tables))
    return infos


def load(rank: int, world: int, path: str, kind: str, step: int | None, expect: int) -> bool:
    """Load ``step`` into a zeroed ``state(kind)`` and compare with what step ``expect``
    saved, gathered: True when every tensor and value matches bit for bit."""
    target = zeroed(state(kind, expect, rank, world))
    dcp.load(target, storage_reader=StorageReader(path, step=step))
    check(target, expect)
    return True


def loads(rank: int, world: int, path: str, cases: list[tuple[str, int]]) -> bool:
    """``load`` of each (kind, step) of ``cases``."""
    return all(load(rank, world, path, kind, step, step) for kind, step in cases)


def check(target: dict, expect: int) -> None:
    got = gathered(target)
    t = full(expect)
    if got["model"]["emb"] is not None:  # a ShardedTensor is gathered on rank 0 only
        assert torch.equal(got["model"]["emb"], t["emb"]), "model.emb"
        assert torch.equal(got["optim"]["acc"], t["acc"]), "optim.acc"
    assert torch.equal(got["model"]["bias"], t["bias"]), "model.bias"
    assert int(got["optim"]["step"]) == expect, got["optim"]["step"]
    assert got["epoch"] == expect and got["note"] == f"step {expect}", (got["epoch"], got["note"])
    assert got["optim"]["lr"] == 0.01 * expect


def bump(s: dict) -> None:
    """What training does to a state between two checkpoints: a few rows of ``emb``."""
    emb = s["model"]["emb"]
    if isinstance(emb, DTensor):  # rows 0..3 are rank 0's
        if dist.get_rank() == 0:
            emb.to_local()[:3] += 1.0
    else:
        emb[:3] += 1.0


def executors(rank: int, world: int, path: str) -> list:
    """dcp.async_save with the thread and the process executor (path writers), then two
    saves through one open group store; the state is changed as soon as async_save
    returns (DCP staged it), and the loads see what each save was given."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    out = []
    for step, how in ((1, AsyncCheckpointerType.THREAD), (2, AsyncCheckpointerType.PROCESS)):
        s = state("dtensor", step, rank, world)
        fut = dcp.async_save(s, storage_writer=StorageWriter(path, step=step, block_rows=32),
                             async_checkpointer_type=how)
        for v in s["model"].values():
            v.to_local().add_(1000.0)  # safe once async_save returned
        fut.result()
        target = zeroed(state("dtensor", step, rank, world))
        dcp.load(target, storage_reader=StorageReader(path, step=step))
        check(target, step)
    with cnrstore.open(path, group=dist.group.WORLD) as store:
        s = state("dtensor", 3, rank, world)
        for step in (3, 4):
            w = StorageWriter(store, step=step)
            dcp.save(s, storage_writer=w)
            out.append((w.info.bytes_written, dict(w.info.rows_changed)))
            bump(s)
        out.append(store.steps())
        target = zeroed(state("dtensor_col", 3, rank, world))  # cut along columns now
        dcp.load(target, storage_reader=StorageReader(store, step=4))
        got = gathered(target)["model"]["emb"]
        want = full(3)["emb"]
        want[:3] += 1.0
        out.append(torch.equal(got, want))
        # saved cut along columns: joined into whole rows, read back row-sharded
        dcp.save(state("dtensor_col", 5, rank, world), storage_writer=StorageWriter(store, step=5))
        target = zeroed(state("dtensor", 5, rank, world))
        dcp.load(target, storage_reader=StorageReader(store, step=5))
        out.append(torch.equal(gathered(target)["model"]["emb"], full(5)["emb"]))
    return out


def failures(rank: int, world: int, path: str) -> list:
    """Saves and loads that fail on one rank or in DCP's own checks: every rank must get
    DCP's CheckpointException and the store must be as it was (step 1 only, intact)."""
    from torch.distributed.checkpoint.api import CheckpointException

    class Faulty(StorageWriter):
        def __init__(self, *a, where: str, **kw):
            super().__init__(*a, **kw)
            self.where = where

        def prepare_local_plan(self, plan):
            if self.where == "prepare_local_plan" and dist.get_rank() == 1:
                raise ValueError("faulty prepare_local_plan")
            return super().prepare_local_plan(plan)

    class FaultyPlanner(dcp.DefaultSavePlanner):
        def resolve_data(self, item):
            if dist.get_rank() == 1:
                raise ValueError("faulty resolve_data")
            return super().resolve_data(item)

    dcp.save(state("dtensor", 1, rank, world), storage_writer=StorageWriter(path, step=1))
    cases = {
        "prepare_local_plan": lambda: dcp.save(
            state("dtensor", 2, rank, world),
            storage_writer=Faulty(path, step=2, where="prepare_local_plan")),
        "write_data": lambda: dcp.save(state("dtensor", 2, rank, world),
                                       storage_writer=StorageWriter(path, step=2),
                                       planner=FaultyPlanner()),
        "past the columns": lambda: dcp.save(
            {"cube": distribute_tensor(torch.zeros(4, 2, 2 * world),
                                       init_device_mesh("cpu", (world,)), [Shard(2)])},
            storage_writer=StorageWriter(path, step=2)),
        "disk full": lambda: _disk_full(rank, lambda: dcp.save(
            state("dtensor", 2, rank, world), storage_writer=StorageWriter(path, step=2))),
        "step exists": lambda: dcp.save(state("dtensor", 2, rank, world),
                                        storage_writer=StorageWriter(path, step=1)),
        "missing step": lambda: dcp.load(zeroed(state("dtensor", 1, rank, world)),
                                         storage_reader=StorageReader(path, step=5)),
        "shape": lambda: dcp.load(
            {"model": {"emb": torch.zeros(ROWS + 1, DIM)}},
            storage_reader=StorageReader(path, step=1)),
    }
    out: list = []
    for name, fn in cases.items():
        try:
            fn()
        except CheckpointException as exc:
            text = " | ".join(f"{r}: {type(e).__name__}: {e}" for r, e in
                              sorted(exc.failures.items()))
            out.append((name, sorted(exc.failures), text))
        else:
            out.append((name, None, "no error"))
    target = zeroed(state("sharded", 1, rank, world))
    dcp.load(target, storage_reader=StorageReader(path))  # the store as it was
    check(target, 1)
    with cnrstore.open(path, group=dist.group.WORLD) as store:
        out.append((store.steps(), store.verify().ok))
    return out


def _disk_full(rank: int, fn) -> None:
    """``fn()`` with rank 1's pack writes failing as a full disk would, inside the put
    that DCP's write_data runs (cnrstore/distributed/commit.py's test hook)."""
    import os

    if rank == 1:
        os.environ["CNRSTORE_DIST_FAIL_AT"] = "dist.rank_before_seal"
    try:
        fn()
    finally:
        os.environ.pop("CNRSTORE_DIST_FAIL_AT", None)


def kept_store(rank: int, world: int, path: str) -> list:
    """Path saves keep their store open between saves (the same handle on every rank),
    until another handle changes the store: rank 0 deletes the last step and collects
    it between two saves, and the next save opens the store afresh on every rank."""
    from cnrstore.dcp import close_stores, stores

    def kept() -> int:
        (e,) = [e for e in stores._entries.values()]
        return id(e.store)

    out = []
    s = state("dtensor", 1, rank, world)
    for step in (1, 2):
        w = StorageWriter(path, step=step, block_rows=32)
        dcp.save(s, storage_writer=w)
        out.append((kept(), dict(w.info.rows_changed)))
        bump(s)
    if rank == 0:
        with cnrstore.open(path) as other:
            other.delete_step(2)
            other.gc(threshold=0.0)
    dist.barrier()
    w = StorageWriter(path, step=3, block_rows=32)
    dcp.save(s, storage_writer=w)  # diffs against step 1, as a fresh open does
    out.append((kept(), dict(w.info.rows_changed)))
    target = zeroed(state("dtensor", 1, rank, world))
    dcp.load(target, storage_reader=StorageReader(path, step=3))
    got = gathered(target)["model"]["emb"]
    want = full(1)["emb"]
    want[:3] += 1.0  # twice, as bump added it (not 2.0: rounding)
    want[:3] += 1.0
    out.append(torch.equal(got, want))
    close_stores()
    out.append(len(stores._entries))
    return out


def load_rounds(rank: int, world: int, path: str) -> list:
    """Rounds of the store's own group in a dcp.load through an open store, beyond those
    of the metadata read: pieces decoded in place (rows) and pieces copied (columns)
    alike. The load must read both in one collective read (request, answer, closing
    round), not a plan round then one read per kind of piece."""
    from cnrstore.dcp import close_stores

    dcp.save(state("dtensor", 1, rank, world),
             storage_writer=StorageWriter(path, step=1, block_rows=32))
    close_stores()
    out = []
    with cnrstore.open(path, group=dist.group.WORLD) as store:
        r0 = store.comm.rounds
        store.metadata(1)
        meta = store.comm.rounds - r0
        for kind in ("dtensor", "dtensor_col"):
            target = zeroed(state(kind, 1, rank, world))
            r0 = store.comm.rounds
            dcp.load(target, storage_reader=StorageReader(store, step=1))
            out.append(store.comm.rounds - r0 - meta)
            check(target, 1)
    return out


def path_load_rounds(rank: int, world: int, path: str) -> list:
    """Rounds of the store's own group in a dcp.load of a path that it opens: the given
    step, the latest (step=None), and a step the store lacks (its error, on every rank)."""
    from cnrstore.dcp import close_stores, stores

    dcp.save(state("dtensor", 1, rank, world),
             storage_writer=StorageWriter(path, step=1, block_rows=32))
    close_stores()
    out: list = []
    for step in (1, None):
        target = zeroed(state("dtensor", 1, rank, world))
        dcp.load(target, storage_reader=StorageReader(path, step=step))
        check(target, 1)
        (entry,) = stores._entries.values()
        out.append(entry.store.comm.rounds)
        close_stores()
    try:
        dcp.load(zeroed(state("dtensor", 1, rank, world)),
                 storage_reader=StorageReader(path, step=9))
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        out.append(type(exc).__name__ + ": " + str(exc))
    close_stores()
    return out

"""Runs a docs/GUIDE.md example on spawned ranks, as torchrun would start them.

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, OMP_NUM_THREADS=1), so the example's own ``dist.init_process_group(...)``
sets the group up, and the names the example takes from the reader's job: this rank's
rows of a row-sharded table, a replicated tensor, a DTensor-sharded model and its
optimizer. Returns "ok" per rank, or the traceback of what failed there."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

from dist_util import free_port

N_TOTAL = 5000      # rows of "user"
M = 7000            # rows of "item", given as two pieces by rank 0


def _names(rank: int, world: int) -> dict:
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(0)
    user = torch.randn(N_TOTAL, 8, generator=g)
    item = torch.randn(M, 4, generator=g)
    per = N_TOTAL // world
    lo, hi = rank * per, (rank + 1) * per if rank < world - 1 else N_TOTAL
    lo2, hi2 = (N_TOTAL - hi, N_TOTAL - lo)       # read back another rank's rows

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (world,))
            self.emb = nn.Parameter(distribute_tensor(torch.randn(64, 4, generator=g), mesh,
                                                      [Shard(0)]))

    dmp = Model()
    opt = torch.optim.Adagrad(dmp.parameters(), lr=0.1)
    # rank 0 holds "item" in two pieces, the other ranks none of it
    a, b = (item[:5000], item[5000:]) if rank == 0 else (item[:0], item[M:])
    return {"local_rows": user[lo:hi].clone(), "lo": lo, "n_total": N_TOTAL,
            "a": a.clone(), "b": b.clone(), "m": M, "dense_weight": torch.ones(3, 3),
            "lo2": lo2, "hi2": hi2, "buf": torch.zeros(hi2 - lo2, 8), "dmp": dmp, "opt": opt,
            "_user": user}


def _main(rank: int, world: int, port: int, code: str, cwd: str, env: dict, prologue: str,
          out) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    os.chdir(cwd)
    try:
        import torch

        torch.set_num_threads(1)
        import cnrstore

        ns: dict = {"__name__": "guide_example", "cnrstore": cnrstore, "torch": torch}
        if prologue:
            exec(prologue, ns)
        if "local_rows" in code:
            # The names are made after the example's init_process_group (the model is a
            # DTensor over the group): run its first statements, then the rest.
            head, sep, rest = code.partition("store = cnrstore.open(")
            exec(head, ns)
            ns.update(_names(rank, world))
            exec(sep + rest, ns)
            want = ns["_user"][ns["lo2"]:ns["hi2"]]    # stored as int8: within its error
            assert torch.equal(ns["buf"], ns["part"]["user"])
            assert torch.allclose(ns["buf"], want, atol=0.05), (ns["buf"] - want).abs().max()
        else:
            exec(code, ns)
        out.put((rank, "ok"))
    except BaseException:
        out.put((rank, traceback.format_exc()))


def run_ranks(world: int, code: str, subs: dict[str, str], *, cwd: str, env: dict | None = None,
              prologue: str = "", timeout: float = 120.0) -> list[str]:
    for old, new in subs.items():
        code = code.replace(old, new)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_main, args=(r, world, port, code, cwd, env or {}, prologue,
                                             out)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, str] = {}
    try:
        for _ in procs:
            rank, what = out.get(timeout=timeout)
            got[rank] = what
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    return [got.get(r, f"rank {r} gave no result") for r in range(world)]

"""Rank programs of the distributed store's tests (module-level: spawned ranks import
them by name)."""

from __future__ import annotations

import os
import time

import torch
from dist_util import BLOCK_ROWS, FANOUT

import cnrstore


def _table(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(200, 4, generator=g)


def _mine(t: torch.Tensor, rank: int, world: int) -> cnrstore.Shard:
    cut = [0, 77, 200] if world == 2 else [round(200 * i / world) for i in range(world + 1)]
    return cnrstore.Shard(t[cut[rank]:cut[rank + 1]], row_offset=cut[rank], rows=200)


def _open(path: str, timeout: float = 20.0):
    import torch.distributed as dist

    return cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                         timeout=timeout)


def bad_input(rank: int, world: int, path: str, how: str):
    """Step 1 fine; step 2 with rank 1's input bad in ``how``: every rank must raise the
    same error class, and no step 2 appears; step 3 then works."""
    with _open(path) as s:
        s.put_tables(1, {"t": _mine(_table(1), rank, world)}, quant="int8")
        t = _table(2)
        tables = {"t": _mine(t, rank, world)}
        if rank == 1 and how == "nan":
            t[150, 2] = float("nan")
        elif rank == 1 and how == "gap":
            tables = {"t": cnrstore.Shard(t[80:200], row_offset=80, rows=200)}
        elif rank == 1 and how == "dtype":
            tables = {"t": cnrstore.Shard(t[77:200].double(), row_offset=77, rows=200)}
        elif rank == 1 and how == "type":
            tables = {"t": "not a tensor"}
        try:
            s.put_tables(2, tables, quant="int8")
            err = None
        except cnrstore.CheckpointError as exc:
            err = (type(exc).__name__, str(exc))
        steps = s.steps()
        info = s.put_tables(3, {"t": _mine(_table(3), rank, world)}, quant="int8")
        return err, steps, info.tables, s.steps()


def killed(rank: int, world: int, path: str, victim: int, point: str):
    """Step 1 fine; during step 2's commit rank ``victim`` SIGKILLs itself at ``point``:
    the others must raise RankFailed within the timeout."""
    s = _open(path, timeout=15.0)
    s.put_tables(1, {"t": _mine(_table(1), rank, world)})
    if rank == victim:
        os.environ["CNRSTORE_CRASH_AT"] = point
    t0 = time.monotonic()
    try:
        s.put_tables(2, {"t": _mine(_table(2), rank, world)})
        err = None
    except cnrstore.CheckpointError as exc:
        err = (type(exc).__name__, str(exc))
    # No close: the group is broken; the process exits without waiting on dead peers.
    return err, time.monotonic() - t0

"""Rank programs of test_dist_pipeline.py: where a distributed put must refuse or store
exactly what a single-process put does, because both run the same checks and seeding."""

from __future__ import annotations

import torch
from dist_util import BLOCK_ROWS, FANOUT

import cnrstore


def _open(path: str, **kw):
    import torch.distributed as dist

    return cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                         timeout=20.0, **kw)


def touched_refusals(rank: int, world: int, path: str, cases: list):
    """The error (class name) of a put with each ``touched`` value, rank 0's rows whole
    and the other ranks' empty; None where the put was taken."""
    out = []
    t = torch.arange(64 * 2, dtype=torch.float32).reshape(64, 2)
    with _open(path) as s:
        for i, ids in enumerate(cases):
            mine = cnrstore.Shard(t if rank == 0 else t[:0], row_offset=0 if rank == 0 else 64,
                                  rows=64)
            try:
                s.put_tables(i, {"t": mine}, touched={"t": ids} if rank == 0 else None)
                out.append(None)
            except cnrstore.CheckpointError as exc:
                out.append(type(exc).__name__)
    return out


def put_over_rot(rank: int, world: int, path: str, table: torch.Tensor, scheme: str):
    """A reopened handle puts ``table`` (rank 0 holds it whole) as step 3 over a store
    whose step 2 has a rotten block of the same content; returns the step's info."""
    with _open(path) as s:
        mine = cnrstore.Shard(table if rank == 0 else table[:0],
                              row_offset=0 if rank == 0 else table.shape[0],
                              rows=table.shape[0])
        info = s.put_tables(3, {"t": mine}, quant=scheme)
        return info.tables, info.rewritten_blocks


CUTS = [[0, 77, 200], [0, 130, 200], [0, 40, 200], [0, 100, 200]]


def moving_steps(steps: int = 8) -> list[torch.Tensor]:
    """A table whose rows change a little at every step (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    t = torch.randn(200, 4, generator=g)
    out = [t.clone()]
    for _ in range(steps - 1):
        t[torch.randint(0, 200, (12,), generator=g)] += 1.0
        out.append(t.clone())
    return out


def moving_queued(rank: int, world: int, path: str):
    """Non-blocking puts, none waited for before the next, whose shards move at every
    step (CUTS), so blocks change owner and their runs are seeded from the store: the
    step ids."""
    futs = []
    with _open(path) as s:
        for step, t in enumerate(moving_steps()):
            c = CUTS[step % len(CUTS)]
            mine = cnrstore.Shard(t[c[rank]:c[rank + 1]], row_offset=c[rank], rows=200)
            futs.append(s.put_tables(step, {"t": mine}, blocking=False))
        return [f.result().tables for f in futs]

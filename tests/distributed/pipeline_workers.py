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

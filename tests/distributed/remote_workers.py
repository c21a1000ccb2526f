"""Rank programs of tests/distributed/test_dist_remote.py (module-level: spawned ranks import
them by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_util import BLOCK_ROWS, FANOUT
from dist_workers import _mine, _open, _table

import cnrstore


def _changed(t: torch.Tensor) -> torch.Tensor:
    """Blocks 3 and 5 (rows 96-127, 160-191: rank 1's at world 2) rewritten; 4 and 6 not."""
    t = t.clone()
    t[96:128] += 1.0
    t[160:192] += 1.0
    return t


def moved_read(rank: int, world: int, where: dict, other_cache: str, retry: bool):
    """Step 1, then step 2 from a handle that does not seed (its unchanged blocks
    deduplicate into step 1's packs); then a gc on ANOTHER cache (another "job") deletes
    step 1 and compacts those packs, so the coordinator's cache hands out stale
    locations. Rank 1 meets a gone pack; with the retry the read still succeeds."""
    t1 = _table(1)
    with _open(where) as s:
        s.put_tables(1, {"t": _mine(t1, rank, world)})
    t2 = _changed(t1)
    from dist_util import located

    path, kw = located(where)
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=20, seed_from_store=False, **kw) as s:
        s.put_tables(2, {"t": _mine(t2, rank, world)})
        dist.barrier()
        if rank == 0:
            grace0 = dict(kw.get("storage_options") or {}, gc_grace_s=0.0)  # delete now
            with cnrstore.open(path, cache_dir=other_cache, storage_options=grace0) as other:
                other.delete_step(1)
                report = other.gc(threshold=0.0)
        dist.barrier()
        if not retry:
            from cnrstore.distributed import transfer

            transfer.again = lambda ds, read: read()  # the read as it was before the retry
        lo, hi = (0, 96) if rank == 0 else (96, 200)
        try:
            got = s.get_tables(2, rows={"t": slice(lo, hi)})["t"]
        except cnrstore.CheckpointError as exc:
            return ("error", type(exc).__name__, str(exc))
        moved = report.packs_rewritten if rank == 0 else None
        return ("ok", torch.equal(got, t2[lo:hi]), moved)

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
    deduplicate into step 1's packs); then both ranks read step 2. Once the coordinator
    has located rank 1's blocks, and before rank 1 reads them, a gc on ANOTHER cache
    (another "job", grace 0) deletes step 1 and compacts: rank 1 holds locations in packs
    that are gone. With the retry the read still succeeds.

    A gc before the read no longer makes such a rank: since gc merges small packs it
    also moves step 2's meta packs, so the coordinator met a gone pack itself loading the
    step node, caught its cache up (engine: pack_missing, refresh) and handed out fresh
    locations.

    Returns (outcome, rounds, seen): outcome ("ok", equal) or ("error", class, message);
    rounds, how many times this rank ran the collective read; seen (rank 1): the packs
    its first locations named, the packs present before and after the gc, and the gc's
    packs_rewritten and packs_deleted."""
    from engine import RecordLocation

    t1 = _table(1)
    with _open(where) as s:
        s.put_tables(1, {"t": _mine(t1, rank, world)})
    t2 = _changed(t1)
    from dist_util import located

    path, kw = located(where)
    seen: dict = {}
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=20, seed_from_store=False, **kw) as s:
        s.put_tables(2, {"t": _mine(t2, rank, world)})
        dist.barrier()
        if rank == 1:
            source = s.readers.source

            def gc_first(answer):
                if not seen:
                    assert answer[0] == "locs", answer[0]
                    seen["given"] = {RecordLocation.from_wire(w).pack for w in answer[2]}
                    grace0 = dict(kw.get("storage_options") or {}, gc_grace_s=0.0)
                    with cnrstore.open(path, cache_dir=other_cache,
                                       storage_options=grace0) as other:
                        storage = other.objects.storage
                        seen["before"] = set(storage.sizes())
                        other.delete_step(1)
                        report = other.gc(threshold=0.0)
                        seen["after"] = set(storage.sizes())
                    seen["gc"] = (report.packs_rewritten, report.packs_deleted)
                return source(answer)

            s.readers.source = gc_first
        from cnrstore.distributed import transfer

        rounds = 0
        again = transfer.again if retry else (lambda ds, read: read())  # no retry

        def counted(ds, read):
            def once():
                nonlocal rounds
                rounds += 1
                return read()
            return again(ds, once)

        transfer.again = counted
        lo, hi = (0, 96) if rank == 0 else (96, 200)
        try:
            got = s.get_tables(2, rows={"t": slice(lo, hi)})["t"]
        except cnrstore.CheckpointError as exc:
            return ("error", type(exc).__name__, str(exc)), rounds, seen
        return ("ok", torch.equal(got, t2[lo:hi])), rounds, seen

"""Rank programs of the boundary-block tests (test_dist_boundary.py; module level: the
spawned ranks import them by name). A step of weights and row-wise optimizer states is
saved by one process; ranks restore it into uneven shards that cut its blocks, and count
the records each rank reads from the store (``Reads``: the engine's own checked reads,
wrapped in this process, on the coordinator's pack store and a rank's located reader
alike)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import cnrstore
from cnrstore import Shard

ROWS, DIM = 300, 6


def tables(step: int, rows: int = ROWS, dim: int = DIM) -> dict[str, torch.Tensor]:
    """The weights "w" and their row-wise accumulator "acc" at ``step``: step 1 random,
    each later step changes a few rows (so later blocks are patch chains)."""
    g = torch.Generator().manual_seed(7)
    w, acc = torch.randn(rows, dim, generator=g), torch.rand(rows, generator=g)
    for _ in range(2, step + 1):
        picked = torch.randperm(rows, generator=g)[: max(1, rows // 10)]
        w[picked] += torch.randn(len(picked), dim, generator=g)
        acc[picked] += 1.0
    return {"w": w, "acc": acc}


def save(path: str, steps: int = 3, *, block_rows: int = 32, quant: Any = "exact",
         rows: int = ROWS, dim: int = DIM) -> None:
    """Steps 1..``steps`` as put_state {"model": {"w"}, "optim": {"acc"}} (one process)."""
    with cnrstore.open(path, block_rows=block_rows, fanout=4) as s:
        for step in range(1, steps + 1):
            t = tables(step, rows, dim)
            s.put_state(step, {"model": {"w": t["w"]}, "optim": {"acc": t["acc"]}},
                        quant=quant)


def block_records(path: str, step: int) -> dict[tuple[str, int], set[bytes]]:
    """{(table, block): the ids of the records a read of that block reads} of ``step``."""
    from cnrstore.format.load import load_step, load_table_manifest

    with cnrstore.open(path) as s:
        objects = s.objects
        node = load_step(objects, step)[1]
        out = {}
        for name, tid in zip(node.tables, node.table_ids):
            tm = load_table_manifest(objects, tid)
            for b, oid in enumerate(tm.block_ids):
                out[(name, b)] = set(objects.locate_closure([oid]))
        return out


class Reads:
    """The records this process reads from the store, by id (count, bytes): every
    checked read of the engine (a record alone, into caller memory, or cut out of a
    coalesced span) goes through one of the functions wrapped here."""

    def __init__(self) -> None:
        self.count: dict[bytes, int] = {}
        self.nbytes = 0

    def note(self, oid: bytes, n: int) -> None:
        self.count[bytes(oid)] = self.count.get(bytes(oid), 0) + 1
        self.nbytes += n

    def install(self) -> Reads:
        import engine.store.batchread as batchread
        import engine.store.core as core
        import engine.store.located as located

        def checked(fn):
            def wrapped(readers, oid, pack, offset, length, *a, **kw):
                got = fn(readers, oid, pack, offset, length, *a, **kw)
                if got is not None:
                    self.note(oid, length)
                return got
            return wrapped

        def raw(fn):
            def wrapped(readers, oid, entry, *a, **kw):
                got = fn(readers, oid, entry, *a, **kw)
                if got is not None:
                    self.note(oid, entry.length)
                return got
            return wrapped

        def cut(fn):
            def wrapped(data, oid, *a, **kw):
                got = fn(data, oid, *a, **kw)
                self.note(oid, len(data))
                return got
            return wrapped

        for mod in (core, located):
            mod.read_checked = checked(mod.read_checked)
            mod.read_raw_into = raw(mod.read_raw_into)
        batchread.checked_record = cut(batchread.checked_record)
        return self


def sharded(t: torch.Tensor, mine: list[tuple[int, int]], fill: float):
    """A ShardedTensor of ``t``'s shape whose local shards on this rank are the row
    pieces ``mine`` (collective: every rank calls it with its own), filled with ``fill``."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    rank = dist.get_rank()
    local = [STShard(torch.full((hi - lo, *t.shape[1:]), fill, dtype=t.dtype),
                     ShardMetadata(shard_offsets=[lo, *[0] * (t.ndim - 1)],
                                   shard_sizes=[hi - lo, *t.shape[1:]],
                                   placement=f"rank:{rank}/cpu"))
             for lo, hi in mine]
    return init_from_local_shards(local, *t.shape)


def restore(rank: int, world: int, path: str, step: int, cuts: list, how: str,
            rows: int = ROWS, dim: int = DIM) -> tuple:
    """Restore ``step`` into this rank's row pieces ``cuts[rank]`` of both tables and
    count the records read. ``how``: "get_tables" (out= a Shard a table: at most one
    piece a rank), "load_state" (a Shard a leaf, likewise) or "sharded" (load_state into
    ShardedTensors of any number of pieces a rank). Returns (every piece equal to the
    saved rows, the record ids read with their counts, the bytes read)."""
    want = tables(step, rows, dim)
    mine = [tuple(p) for p in cuts[rank]]
    store = cnrstore.open(path, group=dist.group.WORLD)
    reads = Reads().install()
    try:
        if how == "sharded":
            leaves = {n: sharded(want[n], mine, 7.0) for n in ("w", "acc")}
            store.load_state(step, {"model": {"w": leaves["w"]},
                                    "optim": {"acc": leaves["acc"]}})
            got = {n: [(s.metadata.shard_offsets[0], s.tensor) for s in leaf.local_shards()]
                   for n, leaf in leaves.items()}
        else:
            assert len(mine) <= 1, mine
            shards = {n: Shard(torch.full((hi - lo, *want[n].shape[1:]), 7.0), row_offset=lo,
                               rows=rows) for n in ("w", "acc") for lo, hi in mine}
            if how == "get_tables":
                store.get_tables(step, out={f"{k}/{n}": shards[n] for k, n in
                                            (("model", "w"), ("optim", "acc")) if n in shards})
            else:
                none = {"w": Shard(torch.zeros(0, dim), 0, rows),
                        "acc": Shard(torch.zeros(0), 0, rows)}
                store.load_state(step, {"model": {"w": shards.get("w", none["w"])},
                                        "optim": {"acc": shards.get("acc", none["acc"])}})
            got = {n: [(s.row_offset, s.local)] for n, s in shards.items()}
        ok = all(torch.equal(t, want[n][lo:lo + t.shape[0]])
                 for n, parts in got.items() for lo, t in parts)
        ok = ok and sorted(lo for lo, _ in got.get("w", [])) == sorted(lo for lo, _ in mine)
    finally:
        store.close()
    return ok, reads.count, reads.nbytes


def failing(rank: int, world: int, path: str, step: int, cuts: list, how: str,
            victim: int, timeout: float = 20.0) -> tuple:
    """A restore (as ``restore``) in which rank ``victim`` fails: "damaged" (a record it
    alone reads is damaged on the disk, by the test), "early" (its read raises before
    it reads anything: a destination it cannot fill), "dies" (it exits in its read,
    before it sends). Returns (the error as (type, text), seconds it took, whether the
    rows stayed those the load started with or were restored, the next get's result)."""
    want = tables(step)
    mine = [tuple(p) for p in cuts[rank]]
    store = cnrstore.open(path, group=dist.group.WORLD, timeout=timeout)
    out = {}
    for lo, hi in mine:  # one piece at most
        out["model/w"] = Shard(torch.full((hi - lo, DIM), 7.0), row_offset=lo, rows=ROWS)
    if rank == victim and how == "early":
        import cnrstore.distributed.boundary as boundary

        def broken(*a: Any, **kw: Any) -> None:
            raise cnrstore.InvalidInput("this rank's destination cannot be filled")

        boundary.in_place = broken  # the read's first step on this rank
    if rank == victim and how == "dies":
        import cnrstore.core.restore as restore_mod

        real = restore_mod.read_rows_into

        def die(*a: Any, **kw: Any) -> Any:
            os._exit(3)

        restore_mod.read_rows_into = die
        import cnrstore.distributed.boundary as boundary

        boundary.read_rows_into = die
        del real
    t0 = time.monotonic()
    err = None
    try:
        store.get_tables(step, out=out)
    except cnrstore.CheckpointError as exc:
        err = (type(exc).__name__, str(exc))
    seconds = time.monotonic() - t0
    after = None
    if how != "dies":
        try:
            again = store.get_tables(step, names=["model/w"], rows={"model/w": slice(0, 5)})
            after = torch.equal(again["model/w"], want["w"][:5])
        except cnrstore.CheckpointError as exc:
            after = (type(exc).__name__, str(exc))
        store.close()
    return err, seconds, after


def moved_boundary(rank: int, world: int, where: dict, other_cache: str) -> tuple:
    """As remote_workers.moved_read, through out= Shards cut at row 100 (block 3, rows
    96..127: rank 1 reads it and sends rank 0 rows 96..99): once the coordinator has
    located rank 1's blocks and before rank 1 reads them, a gc on another cache deletes
    step 1 and compacts, so rank 1 meets a gone pack in the read whose boundary rows it
    sends. Returns (rows right, how many times this rank ran the collective read, the
    plan's pieces this rank received and sent at the first read)."""
    from dist_util import BLOCK_ROWS, FANOUT, located
    from dist_workers import _open, _table
    from remote_workers import _changed

    from cnrstore.distributed import transfer

    cut = [0, 100, 200]
    t1, t2 = _table(1), _changed(_table(1))

    def mine(t: torch.Tensor) -> Shard:
        return Shard(t[cut[rank]:cut[rank + 1]].clone(), row_offset=cut[rank], rows=200)

    with _open(where) as s:
        s.put_tables(1, {"t": mine(t1)})
    path, kw = located(where)
    plans: list = []
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=20, seed_from_store=False, **kw) as s:
        s.put_tables(2, {"t": mine(t2)})
        dist.barrier()
        exchange = s.reader.exchange

        def noted(ds: Any, plan: Any) -> Any:
            plans.append((len(plan[0]), len(plan[1])))
            return exchange(ds, plan)

        s.reader.exchange = noted
        if rank == 1:
            source, gone = s.readers.source, []

            def gc_first(answer: Any) -> Any:
                if not gone:
                    grace0 = dict(kw.get("storage_options") or {}, gc_grace_s=0.0)
                    with cnrstore.open(path, cache_dir=other_cache,
                                       storage_options=grace0) as other:
                        other.delete_step(1)
                        gone.append(other.gc(threshold=0.0).packs_deleted)
                return source(answer)

            s.readers.source = gc_first
        rounds = 0
        again = transfer.again

        def counted(ds: Any, read: Any) -> Any:
            def once() -> Any:
                nonlocal rounds
                rounds += 1
                return read()
            return again(ds, once)

        transfer.again = counted
        out = Shard(torch.zeros(cut[rank + 1] - cut[rank], 4), row_offset=cut[rank], rows=200)
        s.get_tables(2, out={"t": out})
        return torch.equal(out.local, t2[cut[rank]:cut[rank + 1]]), rounds, plans


def _torchrec_helpers() -> None:
    import sys

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torchrec")
    if here not in sys.path:
        sys.path.insert(0, here)


TR_ROWS = (100, 90, 70)


def torchrec_pieces(state: Any) -> dict:
    """path -> [(first row, first column, this rank's piece)] of a TorchRec state's
    sharded leaves (column pieces too)."""
    from cnrstore.distributed.leaves import pieces
    from cnrstore.distributed.torchrec import _leaf_paths

    out = {}
    for path, leaf in _leaf_paths(state):
        got = pieces(leaf, for_fill=True)
        if got is not None:
            out[path] = [(o, c, t.detach().clone()) for t, o, c in got]
    return out


def torchrec_restore(rank: int, world: int, path: str, save: dict, load: dict) -> tuple:
    """A DMP under plan ``save`` (trained a step) saved at step 1, then a DMP of other
    weights under plan ``load`` restored from it by ``ctr.load``, the records read
    counted over the load alone (t2's 4 * world columns: column-wise pieces of 4).
    Returns (saved pieces, loaded pieces, the records read with their counts, bytes)."""
    _torchrec_helpers()
    import trmodels

    from cnrstore.distributed import torchrec as ctr

    a = trmodels.dmp("ebc", save, world, seed=1, rows=TR_ROWS, dims=(4, 4, 4 * world))
    trmodels.train_step(a, "ebc", trmodels.batch("ebc", 3, rows=TR_ROWS, rank=rank,
                                                 world=world))
    store = cnrstore.open(path, group=dist.group.WORLD, block_rows=16)
    store.put_state(1, ctr.state_dict(a))
    saved = torchrec_pieces(ctr.state_dict(a))
    b = trmodels.dmp("ebc", load, world, seed=2, rows=TR_ROWS, dims=(4, 4, 4 * world))
    reads = Reads().install()
    ctr.load(store, 1, b)
    store.close()
    return saved, torchrec_pieces(ctr.state_dict(b)), reads.count, reads.nbytes

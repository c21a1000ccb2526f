"""Where a distributed put plans its rows: the global row grid (the put pipeline's
``Placement`` for DistributedStore; core/put.py runs the pipeline, core/placement.py is a
world of one's). Check every rank's input together, move boundary rows to the block
owners, and seed the runs that have no diff base through the coordinator
(docs/ARCHITECTURE.md, "Many ranks"; docs/FORMAT.md, "Distributed commit").

The objects are those a single-process put of the assembled tables writes: blocks lie on
the global row grid and each is planned by its owner with core/snapshot.py, against the
owner's diff base of exactly that block, and the coordinator builds the segment, table and
step nodes with core/writer.py. So ``StepInfo.tables`` equals a single-process put's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import torch

from cnrstore.core.progress import check_progress
from cnrstore.core.put import RankStructure, Request, Work, check_new_step, forget_failed
from cnrstore.core.seed import seed_blocks
from cnrstore.core.state import merge_structures
from cnrstore.core.tablestate import TableState
from cnrstore.core.validate import (
    check_step,
    check_touched,
    check_writable,
    pack_metadata,
    resolve_quant,
)
from cnrstore.distributed import layout, seed
from cnrstore.errors import InvalidInput, StepExists

# The DistributedStore (cnrstore/distributed/store.py, which imports this module): typed loosely
# so the layers test sees no import cycle.
DistributedStore = Any

__all__ = ["RowGrid"]


def _assembler(run: layout.Run, parts: list, gt: layout.GlobalTable
               ) -> Callable[[], torch.Tensor]:
    """The rows of ``run``, assembled when planned (a view when one part holds them)."""
    return lambda: layout.assemble(run, parts, gt.row_shape, gt.torch_dtype)


def _quant_key(quant: Any) -> Any:
    return quant if isinstance(quant, str) else tuple((k, v) for k, v in dict(quant).items())


class RowGrid:
    """Block b of a table is planned by the rank holding its first row; a run's diff base
    is keyed by (table, first block)."""

    def prepare(self, ds: DistributedStore, step: int, tables: Mapping, *, quant: Any,
                metadata: Mapping | None, touched: Mapping | None, state: dict | None,
                progress: Any) -> Request:
        comm = ds.group
        t0 = time.perf_counter()
        opt = ds.options
        R = opt.rows
        err: BaseException | None = None
        mine = None
        structure = state if isinstance(state, RankStructure) else None
        try:
            if structure is not None and structure.error is not None:
                raise structure.error  # put_state's flatten failed on this rank
            check_step(step)
            check_progress(progress)
            local = layout.local_tables(tables, ds.shard_leaf)
            meta_doc = pack_metadata(metadata)
            rows_touched = check_touched(touched, local, owned={
                n: [(lo, lo + p.shape[0]) for lo, p in t.pieces] for n, t in local.items()})
            if step in ds.pending:
                raise StepExists(step)
            if ds.local is not None:  # the coordinator: the store's index is here
                check_writable(ds.local.objects, "put_tables")
                check_new_step(ds.local.objects, ds.pending, step)
            args = msgpack.packb([step, repr(_quant_key(quant)), meta_doc], use_bin_type=True)
            mine = ({n: t.spec() for n, t in local.items()}, args, sorted(rows_touched),
                    None if structure is None else structure.doc)
        except BaseException as exc:
            err = exc
        got = comm.agree(err, "put_tables: check", mine)
        if len({g[1] for g in got}) > 1:
            raise InvalidInput("put_tables: the ranks passed different steps, quant or "
                               "metadata; every rank must pass the same")
        # The structure stored names every rank's leaves (statestore.put_state): merged
        # here, the same on every rank, or the same error on every rank.
        merged = None if structure is None else merge_structures([g[3] for g in got])
        gtables = layout.global_tables([g[0] for g in got])
        schemes = resolve_quant(quant, {n: t.meta() for n, t in gtables.items()},
                                expected_restores=opt.expected_restores)
        gave_touched = [set(g[2]) for g in got]
        forget_failed(ds)

        # Rows of blocks owned by another rank move to it (shards need not align). The
        # agreed round says which rows go where; the rows themselves go point to point.
        err, outgoing, runs, needs = None, [], [], []
        rows_to: list[list[torch.Tensor]] = [[] for _ in range(comm.world)]
        buf: torch.Tensor | None = None
        sizes: list[int] = []
        try:
            for name, gt in gtables.items():
                lt = local.get(name)
                if lt is None:
                    continue
                snd, own = layout.sends(lt, gt, R, comm.rank)
                tt = rows_touched.get(name)
                for dest, a, t in snd:
                    ids = None if tt is None else tt[(tt >= a) & (tt < a + t.shape[0])]
                    outgoing.append((dest, name, a, int(t.shape[0]), ids))
                    rows_to[dest].append(t)
                for run, parts in own:
                    ids = None if tt is None else tt[(tt >= run.lo) & (tt < run.hi)]
                    runs.append((run, parts, [ids]))
                    if opt.seed_from_store and (name, run.b0) not in ds.states:
                        needs.append((name, run.b0, run.b1))
            buf, sizes = layout.pack(rows_to)
        except BaseException as exc:
            err = exc
        del rows_to
        got = comm.agree(err, "put_tables: rows", (outgoing, needs))
        _receive(comm, got, buf, sizes, gtables, runs)
        del buf
        works = []
        for run, parts, tl in runs:
            gt = gtables[run.name]
            contributors = {r for r, lo, hi in gt.pieces if lo < run.hi and hi > run.lo}
            tids = None
            if all(run.name in gave_touched[r] for r in contributors):
                tids = torch.cat([t for t in tl if t is not None] or
                                 [torch.zeros(0, dtype=torch.int64)]) - run.lo
            works.append(Work(
                run.name, (run.name, run.b0), run.b0, run.b1, run.lo,
                (run.hi - run.lo) * layout.width(gt.row_shape) * gt.torch_dtype.itemsize,
                None, _assembler(run, parts, gt), tids))
        return Request(works, schemes, meta_doc, gtables, t0,
                       extra=[g[1] for g in got], state=merged)

    def bases(self, ds: DistributedStore, req: Request) -> dict[Any, TableState | None]:
        seeded = _seed(ds, req.extra, req.tables, req.schemes)
        # A rank cannot read the store while it writes: its collector is told which
        # records of the seeded bases were unreadable (distributed/commit.py).
        req.damaged = frozenset().union(*(b.damaged_ids for b in seeded.values()))
        return {w.key: ds.states.get(w.key) or seeded.get(w.key) for w in req.works}


def _receive(comm: Any, got: list, buf: torch.Tensor | None, sizes: list[int],
             gtables: dict, runs: list) -> None:
    """Exchange the boundary rows that the agreed ``got`` announces and add those sent to
    this rank to its runs (a view of the receive buffer each; ``assemble`` copies them)."""
    if not any(msgs for msgs, _ in got):
        return  # every rank sees the same: none enters the exchange
    mine = [[m for m in msgs if m[0] == comm.rank] for msgs, _ in got]
    expect = [sum(layout.message_nbytes(gtables[m[1]], m[3]) for m in ms) for ms in mine]
    assert buf is not None  # the agreed round raised otherwise
    received = comm.exchange(buf, sizes, expect, "put_tables: rows")
    for ms, data in zip(mine, received):
        for _, name, a, nrows, ids in ms:
            t, used = layout.unpack(data, gtables[name], nrows)
            data = data[used:]
            for run, parts, tl in runs:
                if run.name == name and run.lo <= a < run.hi:
                    parts.append((a, t))
                    tl.append(ids)


def _seed(ds: DistributedStore, needs: list[list], gtables: dict, schemes: dict
          ) -> dict[tuple[str, int], TableState]:
    """Diff bases from the store for the runs that have none (cnrstore/core/seed.py; the
    coordinator says where: cnrstore/distributed/seed.py).
    A damaged or unreadable store never stops a checkpoint: those runs get no base."""
    if not any(needs):
        return {}
    opt = ds.options
    answers = ds.group.from_coordinator("put_tables: seed",
                                        lambda: seed.answer(ds.local.objects, needs))
    out: dict[tuple[str, int], TableState] = {}
    for (name, b0, b1), got in zip(needs[ds.rank], answers):
        if got is None or (got[2] is None and not ds.is_coordinator):
            continue  # no stored version, or none of these blocks in it
        try:
            objects = ds.local.objects if ds.is_coordinator else ds.readers.source(got[2])
            base = seed_blocks(objects, got[0], got[1], shape=gtables[name].shape,
                               dtype=gtables[name].torch_dtype, scheme=schemes[name],
                               block_rows=opt.rows, fanout=opt.segment_fanout,
                               pool=ds.pool, blocks=(b0, b1))
        except Exception:  # noqa: BLE001 - outside a round: a rank must never diverge here
            base = None  # written full instead; the put still stores the same content
        if base is not None:
            out[(name, b0)] = base
    return out



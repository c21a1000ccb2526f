"""A distributed put: check every rank's input together, move boundary rows to the block
owners, plan and encode on each rank (the stall), then, in every rank's writer thread and
in step order, write the new blocks and commit the step on the coordinator in one engine
transaction (docs/ARCHITECTURE.md, "Many ranks"; docs/FORMAT.md, "Distributed commit").

The objects are those a single-process put of the assembled tables writes: blocks lie on
the global row grid and each is planned by its owner with core/snapshot.py, against the
owner's diff base of exactly that block, and the coordinator builds the segment, table and
step nodes with core/writer.py. So ``StepInfo.tables`` equals a single-process put's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import msgpack
import torch

from cnrstore.codec.quantize import row_nbytes
from cnrstore.core.put import check_new_step, forget_failed, queued
from cnrstore.core.seed import seed_blocks
from cnrstore.core.snapshot import TablePlan, plan_table
from cnrstore.core.tablestate import TableState
from cnrstore.core.validate import (
    check_step,
    check_touched,
    check_writable,
    pack_metadata,
    resolve_quant,
)
from cnrstore.core.writer import StepInfo
from cnrstore.distributed import layout, seed
from cnrstore.distributed.commit import Step, write
from cnrstore.errors import (
    InvalidInput,
    NonFiniteValues,
    StepExists,
    ValueOutOfRange,
)

# The DistributedStore (cnrstore/distributed/store.py, which imports this module): typed loosely
# so the layers test sees no import cycle.
DistributedStore = Any

__all__ = ["put"]



def _quant_key(quant: Any) -> Any:
    return quant if isinstance(quant, str) else tuple((k, v) for k, v in dict(quant).items())


def put(ds: DistributedStore, step: int, tables: Mapping, *, quant: Any,
        metadata: Mapping | None, blocking: bool, touched: Mapping | None,
        state: dict | None = None) -> StepInfo | Future:
    comm = ds.comm
    t0 = time.perf_counter()
    opt = ds.options
    R = opt.rows
    err: BaseException | None = None
    mine = None
    with ds.lock:
        ds.check_open()
        try:
            check_step(step)
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
            mine = ({n: t.spec() for n, t in local.items()}, args, sorted(rows_touched))
        except BaseException as exc:
            err = exc
        got = comm.agree(err, "put_tables: check", mine)
        if len({g[1] for g in got}) > 1:
            raise InvalidInput("put_tables: the ranks passed different steps, quant or "
                               "metadata; every rank must pass the same")
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
        bases = _seed(ds, [g[1] for g in got], gtables, schemes)
        _receive(comm, got, buf, sizes, gtables, runs)
        del buf

        plans: list[tuple[str, int, TablePlan]] = []
        err = None
        try:
            for run, parts, tl in runs:
                gt = gtables[run.name]
                contributors = {r for r, lo, hi in gt.pieces if lo < run.hi and hi > run.lo}
                tids = None
                if all(run.name in gave_touched[r] for r in contributors):
                    tids = torch.cat([t for t in tl if t is not None] or
                                     [torch.zeros(0, dtype=torch.int64)]) - run.lo
                sub = layout.assemble(run, parts, gt.row_shape, gt.torch_dtype)
                plans.append((run.name, run.b0, _plan(ds, run, sub, schemes[run.name],
                                                      tids, None, bases)))
            rnb = {n: p.state.row_nbytes for n, _, p in plans}
        except BaseException as exc:
            _release(plans)
            err, rnb = exc, {}
        try:
            got = comm.agree(err, "put_tables: encode", rnb)
        except BaseException:
            _release(plans)
            raise
        agreed = {n: max(g[n] for g in got if n in g) for n in gtables
                  if any(n in g for g in got)}
        for n, gt in gtables.items():
            agreed.setdefault(n, row_nbytes(schemes[n], gt.torch_dtype,
                                            layout.width(gt.row_shape)))
        if any(g[n] != agreed[n] for g in got for n in g):
            # Another rank's part of a table needed wide qparams: the whole table is wide,
            # as in a single-process put. Replanning is local; all ranks agree again.
            err = None
            try:
                for i, (n, b0, p) in enumerate(plans):
                    if p.state.row_nbytes != agreed[n]:
                        run, parts, tl = next(x for x in runs if x[0].name == n and x[0].b0 == b0)
                        if p.release:
                            p.release()
                        sub = layout.assemble(run, parts, gtables[n].row_shape,
                                              gtables[n].torch_dtype)
                        plans[i] = (n, b0, _plan(ds, run, sub, schemes[n], None, True, bases))
            except BaseException as exc:
                err = exc
            try:
                comm.agree(err, "put_tables: encode wide", None)
            except BaseException:
                _release(plans)
                raise

        job = Step(step, plans, gtables, schemes, agreed, pack_metadata(metadata)
                   if comm.coordinator else {}, state, time.perf_counter() - t0,
                   frozenset().union(*(b.damaged_ids for b in bases.values())))
        fut: Future = Future()
        try:
            ds.writer.submit(lambda: write(ds, job), cleanup=lambda: _release(plans),
                             future=fut)
        finally:
            if ds.writer.queued(fut):
                # Queued (also when interrupted just after): the next put diffs against
                # it; blocks no longer owned by this rank are forgotten.
                queued(ds, step, fut, {(n, b0): p.state for n, b0, p in plans}, gtables)
            else:  # not queued: as a refused put, the bases stay those of the last put
                _release(plans)
    if not blocking:
        return fut
    return fut.result()


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
    answers = ds.from_coordinator(ds.comm, "put_tables: seed",
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


def _plan(ds: DistributedStore, run: layout.Run, sub: torch.Tensor, scheme: str,
          touched: torch.Tensor | None, wide: bool | None, seeded: dict) -> TablePlan:
    opt = ds.options
    base = ds.states.get((run.name, run.b0)) or seeded.get((run.name, run.b0))
    try:
        return plan_table(run.name, sub, scheme=scheme, base=base, wide=wide,
                          block_rows=opt.rows, fanout=opt.segment_fanout,
                          max_chain=opt.max_chain, block_offset=run.b0, touched=touched,
                          buffers=ds.buffers)
    except (NonFiniteValues, ValueOutOfRange) as exc:  # name the global row
        raise type(exc)(exc.table, exc.row + run.lo, exc.scheme) from None


def _release(plans: list[tuple[str, int, TablePlan]]) -> None:
    for _, _, p in plans:
        if p.release:
            p.release()
            p.release = None



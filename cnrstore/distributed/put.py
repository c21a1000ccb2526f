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
from cnrstore.distributed.comm import payloads, wire_error
from cnrstore.errors import InvalidInput, StepExists

# The DistributedStore (cnrstore/distributed/store.py, which imports this module): typed loosely
# so the layers test sees no import cycle.
DistributedStore = Any

__all__ = ["Restructure", "RowGrid"]


class Restructure(Exception):
    """Raised on every rank after a put's check round where a put_state took its
    structure from the handle's last one and some rank's structure changed: nothing was
    planned, and put_state agrees the structure in its round and puts again."""


class _Scratch:
    """The host buffers a put's caller thread fills and no plan keeps (the rows sent, the
    rows received, the boundary blocks assembled), taken from the handle's pool
    (``HostBuffers``) and given back once every run is planned (``Request.release``).
    Fresh memory is first-touched in the stall: at the bench's size (issue 26) each rank
    assembled four 8 MB boundary blocks and sent or received up to 9 MB a put, ~3-4 ms an
    8 MB block fresh against under 1 ms into a reused buffer. A distributed put's plans
    copy the rows they keep from these buffers (a blocking put borrows only a run one of
    the rank's own pieces holds whole), so nothing reads them after planning."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.held: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        buf = self.pool.take(nbytes, pinned=False)
        self.held.append(buf)
        return buf

    def give(self, buf: torch.Tensor | None = None) -> None:
        """Give back ``buf`` if held (None: every buffer held)."""
        back = [b for b in self.held if buf is None or b is buf]
        self.held = [b for b in self.held if not any(b is g for g in back)]
        for b in back:
            self.pool.give(b)

    def drop(self, buf: torch.Tensor) -> None:
        """Never give ``buf`` back (a failed exchange may still be writing into it)."""
        self.held = [b for b in self.held if b is not buf]


def _assembler(run: layout.Run, parts: list, gt: layout.GlobalTable, scratch: _Scratch
               ) -> Callable[[], torch.Tensor]:
    """The rows of ``run``, assembled when planned (a view when one part holds them)."""
    return lambda: layout.assemble(run, parts, gt.row_shape, gt.torch_dtype,
                                   take=scratch.take)


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
        cached = None if structure is None else structure.cached
        if cached is False:  # this rank's structure changed: every rank restarts
            _check_round(comm, None, None, False)  # raises Restructure on every rank
        # Before the round: the bases this rank still trusts are part of what it sends.
        forget_failed(ds)
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
            # What the ranks need to know of the rows that move (which rows go where, and
            # which of them changed) and of the runs to seed is known here, so it rides
            # this round: a block is owned by the rank holding its first row and shards
            # do not overlap, so the rows a rank moves are those of its pieces' leading
            # blocks whose first row it does not hold (``layout.moved``).
            # As numpy arrays: a pickled tensor is unpickled through torch.load, ~1 ms
            # each on every rank for every rank's tables (the tracker's rows, issue 26).
            moved = {n: layout.moved_ids(lt, rows_touched[n], R).numpy()
                     for n, lt in local.items() if n in rows_touched and not lt.plain}
            # A base is a run's only for the same blocks: a run that grew or shrank with
            # the shards is seeded, as its blocks' owner would diff them in one process.
            have = sorted((*k, len(st.slots)) for k, st in ds.states.items()
                          if isinstance(k, tuple)) if opt.seed_from_store else []
            mine = ({n: t.spec() for n, t in local.items()}, args, sorted(rows_touched),
                    None if structure is None else structure.doc, moved, have)
        except BaseException as exc:
            err = exc
        got = _check_round(comm, err, mine, cached)
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
        # Every rank's messages and runs to seed, worked out alike on every rank from what
        # the round carried: no round of their own.
        announced = [_announced(g, r, gtables, R, opt.seed_from_store)
                     for r, g in enumerate(got)]

        # Rows of blocks owned by another rank move to it (shards need not align), point to
        # point. A rank that fails from here on still sends (zeros) what was announced and
        # raises its error in the width round (``Request.error``), so every rank does.
        lerr: BaseException | None = None
        runs: list = []
        rows_to: list[list[torch.Tensor]] = [[] for _ in range(comm.world)]
        buf: torch.Tensor | None = None
        scratch = _Scratch(ds.buffers)
        sent: torch.Tensor | None = None
        sizes = [sum(layout.message_nbytes(gtables[m[1]], m[3]) for m in announced[comm.rank][0]
                     if m[0] == d) for d in range(comm.world)]
        try:
            for name, gt in gtables.items():
                lt = local.get(name)
                if lt is None:
                    continue
                snd, own = layout.sends(lt, gt, R, comm.rank)
                tt = rows_touched.get(name)
                for dest, _a, t in snd:
                    rows_to[dest].append(t)
                for run, parts in own:
                    ids = None if tt is None else tt[(tt >= run.lo) & (tt < run.hi)]
                    runs.append((run, parts, [ids]))
            if sum(sizes):
                sent = scratch.take(sum(sizes))
            buf, packed = layout.pack(rows_to, sent)
            if packed != sizes:
                raise AssertionError(f"put_tables: rows packed {packed}, announced {sizes} "
                                     "(a bug: report it)")
        except BaseException as exc:
            lerr, runs = exc, []
            buf = torch.zeros(sum(sizes), dtype=torch.uint8)
        del rows_to
        own_ids = {id(t) for _, parts, _ in runs for _, t in parts}

        def own_part(t: torch.Tensor) -> bool:
            return id(t) in own_ids

        try:
            _receive(comm, announced, buf, sizes, gtables, runs, scratch)
        except BaseException as exc:
            lerr, runs = lerr or exc, []
        del buf
        if sent is not None:
            scratch.give(sent)
        if lerr is not None:
            scratch.give()
        works = []
        for run, parts, tl in runs:
            gt = gtables[run.name]
            # A run one of this rank's own pieces holds whole is planned from that piece
            # itself (its first part: the rows received come after the rank's own), so a
            # blocking put may borrow it (CoordinatorCommit.plan_options); a run
            # assembled into the scratch buffers never is.
            whole = None if layout.assembles(run, parts) or not own_part(parts[0][1]) \
                else parts[0][1]
            contributors = {r for r, lo, hi in gt.pieces if lo < run.hi and hi > run.lo}
            tids = None
            if all(run.name in gave_touched[r] for r in contributors):
                tids = torch.cat([t for t in tl if t is not None] or
                                 [torch.zeros(0, dtype=torch.int64)]) - run.lo
            works.append(Work(
                run.name, (run.name, run.b0), run.b0, run.b1, run.lo,
                (run.hi - run.lo) * layout.width(gt.row_shape) * gt.torch_dtype.itemsize,
                whole, None if whole is not None else _assembler(run, parts, gt, scratch),
                tids))
        return Request(works, schemes, meta_doc, gtables, t0,
                       extra=[n for _, n in announced], state=merged, error=lerr,
                       release=scratch.give)

    def bases(self, ds: DistributedStore, req: Request) -> dict[Any, TableState | None]:
        seeded = _seed(ds, req.extra, req.tables, req.schemes)
        # A rank cannot read the store while it writes: its collector is told which
        # records of the seeded bases were unreadable (distributed/commit.py).
        req.damaged = frozenset().union(*(b.damaged_ids for b in seeded.values()))
        out: dict[Any, TableState | None] = {}
        for w in req.works:
            own = ds.states.get(w.key)
            fits = own is not None and len(own.slots) == w.b1 - w.b0  # see ``have``
            out[w.key] = own if fits else seeded.get(w.key)
        return out


def _check_round(comm: Any, err: BaseException | None, mine: Any, cached: bool | None
                 ) -> list:
    """Every rank's check facts, or the lowest rank's error raised on every rank. Where
    put_state took the structure from its last put (``cached``), a rank whose structure
    changed sends None and every rank raises Restructure, before any rank's error: those
    were found in a structure that is not the state's."""
    if cached is None:
        return comm.agree(err, "put_tables: check", mine)
    sent = None if cached is False else (None if err is None else wire_error(err), mine)
    every = comm.all_gather(sent, "put_tables: check")
    if any(e is None for e in every):
        raise Restructure()
    return payloads(every, comm.rank, err)


def _announced(got: tuple, rank: int, gtables: dict, R: int, seed: bool
               ) -> tuple[list, list]:
    """(the rows rank ``rank`` sends: (dest, table, first row, rows, touched ids or
    None), in the order it packs them; the runs it seeds: (table, b0, b1)), from what it
    gave in the check round ``got``."""
    specs, have = got[0], {tuple(k) for k in got[5]}
    msgs: list = []
    needs: list = []
    for name, gt in gtables.items():
        spec = specs.get(name)
        if spec is None:
            continue
        moved = got[4].get(name)
        for dest, a, n in layout.moves(spec, gt, R, rank):
            ids = None if moved is None else torch.from_numpy(
                moved[(moved >= a) & (moved < a + n)])
            msgs.append((dest, name, a, n, ids))
        if seed:
            needs += [(name, run.b0, run.b1) for run in layout.runs(gt, R)
                      if run.rank == rank and (name, run.b0, run.b1 - run.b0) not in have]
    return msgs, needs


def _receive(comm: Any, got: list, buf: torch.Tensor, sizes: list[int],
             gtables: dict, runs: list, scratch: _Scratch) -> None:
    """Exchange the boundary rows that ``got`` (every rank's ``_announced``) announces and
    add those sent to this rank to its runs (a view of the receive buffer each, one of
    ``scratch``'s; ``assemble`` copies them)."""
    if not any(msgs for msgs, _ in got):
        return  # every rank sees the same: none enters the exchange
    mine = [[m for m in msgs if m[0] == comm.rank] for msgs, _ in got]
    expect = [sum(layout.message_nbytes(gtables[m[1]], m[3]) for m in ms) for ms in mine]
    into = scratch.take(sum(expect)) if sum(expect) else None
    try:
        received = comm.exchange(buf, sizes, expect, "put_tables: rows", into)
    except BaseException:
        if into is not None:
            scratch.drop(into)
        raise
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
    # The newest stored version once the queued puts are in, as a world of one seeds
    # (core/placement.py): read with one still queued, a base (so the ids) depended on
    # whether the writer had committed it yet. Every rank sees the same needs.
    ds.drain()
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



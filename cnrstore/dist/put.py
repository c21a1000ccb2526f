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

import dataclasses
import time
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import msgpack
import torch

from cnrstore.codec.quantize import row_nbytes
from cnrstore.core.lineage import commit_check
from cnrstore.core.options import ensure_stored
from cnrstore.core.snapshot import TablePlan, plan_table
from cnrstore.core.tablestate import BlockSlot, TableState
from cnrstore.core.validate import check_step, pack_metadata, resolve_quant
from cnrstore.core.writer import StepInfo, write_blocks, write_nodes
from cnrstore.dist import layout, transfer
from cnrstore.errors import (
    InvalidInput,
    InvalidType,
    NonFiniteValues,
    StepExists,
    StepOrderError,
    ValueOutOfRange,
    WriteFailed,
)
from cnrstore.format.manifest import KIND_STEP, StepNode, list_steps, root_name
from engine import RootExists, crashpoints, object_id

# The DistributedStore (cnrstore/dist/store.py, which imports this module): typed loosely
# so the layers test sees no import cycle.
DistributedStore = Any

__all__ = ["put", "CRASH_POINTS"]

# Named points of the distributed commit where crash tests SIGKILL a rank
# (CNRSTORE_CRASH_AT, engine/crashpoints.py; docs/FORMAT.md "Distributed commit"). With
# the engine's sink.*, adopt.* and writer.* points they cover every step of the protocol.
CRASH_POINTS = (
    "dist.rank_after_encode",     # blocks encoded and ids known; nothing written
    "dist.rank_before_seal",      # a rank's records appended to its packs, not sealed
    "dist.rank_after_seal",       # a rank's packs sealed, locations not yet reported
    "dist.coord_before_commit",   # nodes built, records adopted; nothing published
    "dist.coord_after_commit",    # the step is committed; ranks not yet told
)


def _touched(touched: Mapping | None, local: dict[str, layout.LocalTable]
             ) -> dict[str, torch.Tensor]:
    """Touched rows per table, global row ids within this rank's own rows."""
    if touched is None:
        return {}
    if not isinstance(touched, Mapping):
        raise InvalidType(f"touched must be a mapping name -> row ids, got {type(touched)}")
    out = {}
    for name, ids in touched.items():
        if name not in local:
            raise InvalidInput(f"touched names table {name!r} that is not in this rank's put")
        try:
            t = torch.as_tensor(ids).flatten().to("cpu", torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidType(f"touched[{name!r}] is not a sequence of row ids: {exc}") from exc
        inside = torch.zeros(t.shape, dtype=torch.bool)
        for lo, piece in local[name].pieces:
            inside |= (t >= lo) & (t < lo + piece.shape[0])
        if not bool(inside.all()):
            raise InvalidInput(f"touched[{name!r}] has row ids outside this rank's rows "
                               "(touched takes global row ids of the rank's own shards)")
        out[name] = t
    return out


def _quant_key(quant: Any) -> Any:
    return quant if isinstance(quant, str) else tuple((k, v) for k, v in dict(quant).items())


@dataclasses.dataclass
class _Step:
    """What the writer round of a step needs, from the planning on this rank."""

    step: int
    plans: list[tuple[str, int, TablePlan]]             # (table, first block, plan)
    tables: dict[str, layout.GlobalTable]
    schemes: dict[str, str]
    rnb: dict[str, int]
    metadata: dict
    state: dict | None
    stall: float


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
            rows_touched = _touched(touched, local)
            if step in ds.pending:
                raise StepExists(step)
            if ds.local is not None:
                ds.local._core.check_writable("put_tables")
                if ds.local.objects.root(root_name(step)) is not None:
                    raise StepExists(step)
                known = list_steps(ds.local.objects)
                highest = max([*known[-1:], *ds.pending], default=None)
                if highest is not None and step < highest:
                    raise StepOrderError(step, highest)
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
        if ds.failed:  # a background put failed: the diff bases cannot be trusted
            ds.states.clear()
            ds.failed = False

        # Rows of blocks owned by another rank move to it (shards need not align).
        err, outgoing, runs = None, [], []
        try:
            for name, gt in gtables.items():
                lt = local.get(name)
                if lt is None:
                    continue
                snd, own = layout.sends(lt, gt, R, comm.rank)
                tt = rows_touched.get(name)
                for dest, a, t in snd:
                    ids = None if tt is None else tt[(tt >= a) & (tt < a + t.shape[0])]
                    outgoing.append((dest, name, a, t.cpu(), ids))
                for run, parts in own:
                    ids = None if tt is None else tt[(tt >= run.lo) & (tt < run.hi)]
                    runs.append((run, parts, [ids]))
        except BaseException as exc:
            err = exc
        got = comm.agree(err, "put_tables: rows", outgoing)
        for src, msgs in enumerate(got):
            for dest, name, a, t, ids in msgs:
                if dest != comm.rank:
                    continue
                for run, parts, tl in runs:
                    if run.name == name and run.lo <= a < run.hi:
                        parts.append((a, t))
                        tl.append(ids)

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
                sub = layout.assemble(run, parts, gt.row_shape, layout_dtype(gt))
                plans.append((run.name, run.b0, _plan(ds, run, sub, schemes[run.name],
                                                      tids, None)))
            rnb = {n: p.state.row_nbytes for n, _, p in plans}
        except BaseException as exc:
            _release(plans)
            err, rnb = exc, {}
        try:
            got = comm.agree(err, "put_tables: encode", rnb)
        except BaseException:
            _release(plans)
            raise
        agreed = {n: max(g[n] for g in got if n in g) for n in gtables if any(n in g for g in got)}
        for n, gt in gtables.items():
            agreed.setdefault(n, row_nbytes(schemes[n], layout_dtype(gt), layout.width(gt.row_shape)))
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
                                              layout_dtype(gtables[n]))
                        plans[i] = (n, b0, _plan(ds, run, sub, schemes[n], None, True))
            except BaseException as exc:
                err = exc
            comm.agree(err, "put_tables: encode wide", None)

        job = _Step(step, plans, gtables, schemes, agreed, pack_metadata(metadata)
                    if comm.coordinator else {}, state, time.perf_counter() - t0)
        for n in gtables:  # the new diff bases; blocks no longer owned are forgotten
            for key in [k for k in ds.states if k[0] == n]:
                del ds.states[key]
        for n, b0, p in plans:
            ds.states[(n, b0)] = p.state
        fut: Future = Future()
        ds.writer.submit(lambda: _write(ds, job), cleanup=lambda: _release(plans), future=fut)
        ds.pending[step] = fut
        fut.add_done_callback(lambda _: ds.pending.pop(step, None))
    if not blocking:
        return fut
    return fut.result()


def layout_dtype(gt: layout.GlobalTable) -> torch.dtype:
    return gt.torch_dtype


def _plan(ds: DistributedStore, run: layout.Run, sub: torch.Tensor, scheme: str,
          touched: torch.Tensor | None, wide: bool | None) -> TablePlan:
    opt = ds.options
    base = ds.states.get((run.name, run.b0))
    try:
        return plan_table(run.name, sub, scheme=scheme, base=base, wide=wide,
                          block_rows=opt.rows, fanout=opt.segment_fanout,
                          max_chain=opt.max_chain, touched=touched, buffers=ds.buffers)
    except (NonFiniteValues, ValueOutOfRange) as exc:  # name the global row
        raise type(exc)(exc.table, exc.row + run.lo, exc.scheme) from None


def _release(plans: list[tuple[str, int, TablePlan]]) -> None:
    for _, _, p in plans:
        if p.release:
            p.release()
            p.release = None


class _Collector:
    """Stands in for an engine Writer while a rank encodes its blocks: objects are kept
    (with their ids) until the coordinator says which the store lacks."""

    def __init__(self, known: set[bytes]):
        self.objects: dict[bytes, tuple[int, bytes, tuple[bytes, ...]]] = {}
        self.bases: set[bytes] = set()
        self._known = known

    def put(self, kind: int, payload: Any, refs: Any = (), *, meta: bool = False) -> bytes:
        refs = tuple(bytes(r) for r in refs)
        payload = bytes(payload)
        oid = object_id(kind, refs, payload)
        self.objects.setdefault(oid, (kind, payload, refs))
        self.bases.update(r for r in refs if r not in self.objects)
        return oid

    def has(self, oid: bytes) -> bool:
        return oid in self.objects or oid in self._known


def _write(ds: DistributedStore, job: _Step) -> StepInfo:
    """The writer round of one step, on every rank in step order (ds.wcomm)."""
    try:
        return _write_round(ds, job)
    except BaseException:
        ds.failed = True
        raise


def _write_round(ds: DistributedStore, job: _Step) -> StepInfo:
    comm = ds.wcomm
    err: BaseException | None = None
    coll = None
    ask: Any = None
    try:
        known = {s.oid for _, _, p in job.plans for s in (p.base_slots or []) if s and s.oid}
        coll = _Collector(known)
        for _, _, plan in job.plans:
            write_blocks(coll, plan, None)
        ask = ([(o, len(v[1])) for o, v in coll.objects.items()], sorted(coll.bases))
        crashpoints.hit("dist.rank_after_encode")
    except BaseException as exc:
        err = exc
    asks = comm.agree(err, "put: blocks", ask)

    def decide() -> list:
        objects = ds.local.objects
        allo = [o for oids, _ in asks for o, _ in oids]
        bases = sorted({b for _, bs in asks for b in bs})
        miss = transfer.missing(objects, allo + bases)
        gone = [b for b in bases if b in miss]
        if gone:
            raise WriteFailed(job.step, f"base block {gone[0].hex()} is missing (an earlier "
                                        "put failed or gc dropped it)")
        taken: set[bytes] = set()
        per, sizes = [], []
        for oids, _ in asks:
            mine = [o for o, _ in oids if o in miss and o not in taken]
            taken.update(mine)
            per.append(mine)
            size = dict(oids)
            sizes.append(sum(size[o] for o in mine))
        given = transfer.grants(objects, sizes)
        granted.extend(given)
        return list(zip(per, given))

    granted: list = []  # the coordinator's leases, ended whatever the outcome
    try:
        return _write_rest(ds, job, comm, coll, decide)
    finally:
        if granted:
            transfer.release(ds.local.objects, granted)


def _write_rest(ds: DistributedStore, job: _Step, comm: Any, coll: Any, decide: Any
                ) -> StepInfo:
    assigned, grant = ds.from_coordinator(comm, "put: assign", decide)
    err, report, up = None, None, None
    try:
        assert coll is not None
        up = transfer.Uploader(grant)
        for oid in assigned:
            kind, payload, refs = coll.objects[oid]
            up.put(kind, payload, refs)
        crashpoints.hit("dist.rank_before_seal")
        sealed = up.seal()
        crashpoints.hit("dist.rank_after_seal")
        slots = {(n, b0): [(s.oid, s.depth, s.chain_bytes) for s in p.state.slots
                           if s is not None] for n, b0, p in job.plans}
        changed: dict[str, int] = {}
        for n, _, p in job.plans:
            changed[n] = changed.get(n, 0) + p.rows_changed
        report = (sealed, slots, changed)
    except BaseException as exc:
        err = exc
        if up is not None:
            up.discard()
    reports = comm.agree(err, "put: sealed", report)
    info = ds.from_coordinator(comm, "put: commit", lambda: _commit(ds, job, reports),
                               scatter=False)
    root = bytes.fromhex(info.root)
    for _, _, p in job.plans:
        p.state.anchor = (root_name(job.step), root)
    return dataclasses.replace(info, stall_seconds=job.stall)


def _commit(ds: DistributedStore, job: _Step, reports: list) -> StepInfo:
    """On the coordinator: adopt the ranks' records, build the nodes, commit the step."""
    t0 = time.perf_counter()
    objects = ds.local.objects
    opt = ds.options
    R = opt.rows
    slots: dict[str, dict[int, list]] = {}
    changed: dict[str, int] = {}
    for _, sl, ch in reports:
        for (n, b0), s in sl.items():
            slots.setdefault(n, {})[b0] = s
        for n, c in ch.items():
            changed[n] = changed.get(n, 0) + c
    w = objects.writer(timeout=opt.lock_timeout)
    try:
        commit_check(objects, job.step)()
        ensure_stored(objects, w, opt)
        rank_bytes, rank_payload = transfer.adopt(w, [r[0] for r in reports])
        table_ids = []
        logical = 0
        for name, gt in job.tables.items():
            dtype = layout_dtype(gt)
            logical += gt.rows * layout.width(gt.row_shape) * dtype.itemsize
            flat: list[BlockSlot | None] = []
            for b0 in sorted(slots.get(name, {})):
                for i, (oid, depth, chain) in enumerate(slots[name][b0]):
                    start = (b0 + i) * R
                    flat.append(BlockSlot(min(R, gt.rows - start), depth, chain, oid))
            if len(flat) != -(-gt.rows // R):
                raise WriteFailed(job.step, f"table {name!r}: {len(flat)} blocks reported "
                                            f"for {gt.rows} rows")
            st = TableState(gt.shape, dtype, job.schemes[name], R, opt.segment_fanout,
                            job.rnb[name], flat, segments=ds.segments.get(name, []))
            table_ids.append(write_nodes(w, name, st))
            ds.segments[name] = st.segments
        crashpoints.hit("dist.coord_before_commit")
        node = StepNode(step=job.step, time=time.time(), tables=tuple(job.tables),
                        table_ids=tuple(table_ids), metadata=job.metadata,
                        logical_bytes=logical, bytes_new=rank_payload + w.payload_bytes_new,
                        rows_changed={n: changed.get(n, 0) for n in job.tables},
                        state=job.state)
        payload, refs = node.encode()
        root = w.put(KIND_STEP, payload, refs, meta=True)
        bytes_new = node.bytes_new
        w.create_root(root_name(job.step), root)
        commit = w.commit()
    except RootExists:
        w.abort()
        ds.segments.clear()
        raise StepExists(job.step) from None
    except BaseException:
        w.abort()
        ds.segments.clear()
        raise
    crashpoints.hit("dist.coord_after_commit")
    return StepInfo(
        step=job.step, root=root.hex(), bytes_written=commit.bytes_written + rank_bytes,
        logical_bytes=logical, rows_changed=dict(node.rows_changed),
        objects_new=commit.objects_new, objects_reused=commit.objects_reused,
        bytes_new=bytes_new, stall_seconds=job.stall,
        write_seconds=time.perf_counter() - t0,
        tables={n: tid.hex() for n, tid in zip(job.tables, table_ids)},
    )

"""The writer round of a distributed put, on every rank in step order (the store's second
gloo group): encode the planned blocks, learn from the coordinator which the store lacks,
write those into reserved packs and seal them, then the coordinator adopts every rank's
records, builds the segment, table and step nodes with core/writer.py and commits the step
in ONE engine transaction; its StepInfo or error reaches every rank (docs/FORMAT.md,
"Distributed commit", lists the rules and crash points).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from cnrstore.codec.quantize import row_nbytes, scheme_bits
from cnrstore.core.lineage import commit_check
from cnrstore.core.options import ensure_stored
from cnrstore.core.put import Plans, Request
from cnrstore.core.snapshot import TablePlan
from cnrstore.core.tablestate import BlockSlot, TableState
from cnrstore.core.writer import StepInfo, write_blocks, write_nodes
from cnrstore.distributed import layout, transfer
from cnrstore.errors import CheckpointError, StepExists, WriteFailed, translate
from cnrstore.format.manifest import KIND_STEP, StepNode, root_name
from engine import RootExists, StoreError, crashpoints, object_id

__all__ = ["CoordinatorCommit", "Step", "write", "CRASH_POINTS"]

# The DistributedStore (cnrstore/distributed/store.py): typed loosely, no import cycle.
DistributedStore = Any

# Named points of the distributed commit where crash tests SIGKILL a rank
# (CNRSTORE_CRASH_AT, engine/crashpoints.py; docs/FORMAT.md "Distributed commit"). With
# the engine's sink.*, adopt.* and writer.* points they cover every step of the protocol.
CRASH_POINTS = (
    "dist.rank_after_plan",       # a non-blocking put's first run planned on the writer
    "dist.rank_after_encode",     # blocks encoded and ids known; nothing written
    "dist.rank_before_seal",      # a rank's records appended to its packs, not sealed
    "dist.rank_after_seal",       # a rank's packs sealed, locations not yet reported
    "dist.coord_before_commit",   # nodes built, records adopted; nothing published
    "dist.coord_after_commit",    # the step is committed; ranks not yet told
)


@dataclasses.dataclass
class Step:
    """What the writer round of a step needs, from the planning on this rank."""

    step: int
    plans: list[tuple[str, int, TablePlan]]             # (table, first block, plan)
    tables: dict[str, layout.GlobalTable]
    schemes: dict[str, str]
    rnb: dict[str, int]
    metadata: dict
    state: dict | None
    stall: float
    damaged: frozenset[bytes] = frozenset()  # unreadable records of the seeded bases
    # This rank's planning failed (no width round: ``CoordinatorCommit.known_widths``):
    # the writer round's first agreement raises it on every rank.
    error: BaseException | None = None



class _Collector:
    """Stands in for an engine Writer while a rank encodes its blocks: objects are kept
    (with their ids) until the coordinator says which the store lacks."""

    def __init__(self, known: set[bytes], damaged: frozenset[bytes] = frozenset()):
        self.objects: dict[bytes, tuple[int, bytes, tuple[bytes, ...]]] = {}
        self.bases: set[bytes] = set()
        self._known = known
        self._damaged = damaged

    def put(self, kind: int, payload: Any, refs: Any = (), *, meta: bool = False) -> bytes:
        refs = tuple(bytes(r) for r in refs)
        payload = bytes(payload)
        oid = object_id(kind, refs, payload)
        self.objects.setdefault(oid, (kind, payload, refs))
        self.bases.update(r for r in refs if r not in self.objects)
        return oid

    def has(self, oid: bytes) -> bool:
        return oid in self.objects or oid in self._known or oid in self._damaged

    def missing(self, oids: Iterable[bytes]) -> set[bytes]:
        """engine Writer.missing: those of ``oids`` ``has`` says are absent."""
        return {bytes(o) for o in oids if not self.has(o)}

    def get(self, oid: bytes) -> None:
        """Whether a record the store has can be read, as write_blocks asks it of a block
        whose base was damaged (it never writes onto an unreadable record of the same
        id): this rank read the seeded bases, so it knows which records failed."""
        if oid in self._damaged:
            raise StoreError(f"object {oid.hex()} could not be read when the base was seeded")


class CoordinatorCommit:
    """The put pipeline's ``Commit`` for many ranks (core/put.py; a world of one's is
    core/commit.py): every rank encodes its blocks into a collector on its writer thread,
    writes those the store lacks into packs of its own, and the coordinator adopts them
    and commits the step. A rank cannot read the store, so it keeps no full codes; a
    non-blocking put copies the rows its runs write before it returns, a blocking one
    borrows the runs its own pieces hold whole (``plan_options``)."""

    def plan_options(self, ds: DistributedStore, req: Request, *, blocking: bool,
                     keep_full: bool) -> list[dict]:
        # A non-blocking put's tracked runs are planned on the writer thread, their rows
        # copied in the stall (core/writerplan.py; issue 26); ``write``
        # plans them before its first round, so a failure there fails every rank's step.
        # A blocking put borrows the runs a rank's own piece holds whole (Work.table):
        # a whole exact run is then encoded from the caller's tensor, not from a
        # staging copy of it (``write`` checks the caller still waits once it has read it).
        return [{"defer_plan": not blocking, "borrow": blocking and w.table is not None}
                for w in req.works]

    def known_widths(self, ds: DistributedStore, req: Request) -> dict[str, int] | None:
        """Without an intN table every row width follows from the scheme and dtype, so
        the ranks need no width round: a rank whose planning fails says so in the
        writer round's first agreement (``Step.error``), which fails the step on every
        rank, as a write failing there does. The caller then returns once its own runs
        are planned, not once the slowest rank's are (issue 26)."""
        if any(scheme_bits(s) is not None for s in req.schemes.values()):
            return None
        return {n: row_nbytes(req.schemes[n], gt.torch_dtype, layout.width(gt.row_shape))
                for n, gt in req.tables.items()}

    def job(self, ds: DistributedStore, step: int, req: Request, plans: Plans,
            widths: dict[str, int], stall: float, state: dict | None,
            error: BaseException | None = None) -> Callable[[], StepInfo]:
        widths = dict(widths)
        for n, gt in req.tables.items():  # a table no rank holds a block of (no rows)
            widths.setdefault(n, row_nbytes(req.schemes[n], gt.torch_dtype,
                                            layout.width(gt.row_shape)))
        job = Step(step, plans, req.tables, req.schemes, widths,
                   req.meta_doc if ds.group.coordinator else {}, state, stall, req.damaged,
                   error)
        return lambda: write(ds, job)


def _point(name: str) -> None:
    """A named point of the protocol: crash tests SIGKILL here (CNRSTORE_CRASH_AT), failure
    tests make this rank's write fail here as a full disk would (CNRSTORE_DIST_FAIL_AT)."""
    crashpoints.hit(name)
    if os.environ.get("CNRSTORE_DIST_FAIL_AT") == name:
        raise OSError(errno.ENOSPC, f"No space left on device (test hook at {name})")


def _local(err: BaseException | None, step: int) -> BaseException | None:
    """A rank's own failure as the error every rank raises: cnrstore's errors as they are,
    the engine's translated, anything else (OSError: a full disk) as WriteFailed."""
    if err is None or isinstance(err, CheckpointError):
        return err
    if isinstance(err, StoreError):
        return translate(err)
    return WriteFailed(step, f"{type(err).__name__}: {err}")


def write(ds: DistributedStore, job: Step) -> StepInfo:
    """The writer round of one step, on every rank in step order (ds.wcomm)."""
    comm = ds.wcomm
    err: BaseException | None = None
    coll = None
    ask: Any = None
    try:
        if job.error is not None:
            raise job.error
        for _, _, plan in job.plans:
            plan.encoded()  # a deferred plan is made here, before its writes are read
            _point("dist.rank_after_plan")
        known = {s.oid for _, _, p in job.plans for s in (p.base_slots or []) if s and s.oid}
        known |= {bw.base.oid for _, _, p in job.plans for bw in p.writes
                  if bw.base is not None and bw.base.oid}  # merged patches' full blocks
        # the grouped layout's listed row objects of earlier steps, which its next
        # versions list again (the coordinator checks the store has them: coll.bases)
        known |= {p.oid for _, _, pl in job.plans for s in (pl.base_slots or [])
                  if s and s.group is not None for p in s.group.pieces if p.oid}
        coll = _Collector(known, job.damaged)
        for _, _, plan in job.plans:
            write_blocks(coll, plan, coll.get)
        if any(p.borrowed is not None and p.borrowed.is_set() for _, _, p in job.plans):
            # The collector holds copies of every record: a borrowed table is not read
            # past this point, so what it read was read while the caller waited, or the
            # step fails on every rank (a world of one's check: core/commit.py).
            raise WriteFailed(job.step, "the caller stopped waiting (interrupted) before "
                                        "its tables were read; nothing was committed")
        ask = ([(o, len(v[1])) for o, v in coll.objects.items()], sorted(coll.bases))
        _point("dist.rank_after_encode")
    except BaseException as exc:
        err = exc
    # A planning error goes as it is, as the width round sent it (``Step.error``).
    asks = comm.agree(err if err is job.error else _local(err, job.step), "put: blocks", ask)

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


def _write_rest(ds: DistributedStore, job: Step, comm: Any, coll: Any, decide: Any
                ) -> StepInfo:
    assigned, grant = comm.from_coordinator("put: assign", decide)
    err, report, up = None, None, None
    try:
        assert coll is not None
        up = transfer.Uploader(grant, ds.storage)
        for oid in assigned:
            kind, payload, refs = coll.objects[oid]
            up.put(kind, payload, refs)
        _point("dist.rank_before_seal")
        sealed = up.seal()
        _point("dist.rank_after_seal")
        slots = {(n, b0): [(s.oid, s.depth, s.chain_bytes) for s in p.state.slots
                           if s is not None] for n, b0, p in job.plans}
        changed: dict[str, tuple[int, int]] = {}
        for n, _, p in job.plans:
            c, w = changed.get(n, (0, 0))
            changed[n] = (c + p.rows_changed, w + len(p.codes))
        report = (sealed, slots, changed, sum(p.rewritten_blocks for _, _, p in job.plans))
    except BaseException as exc:
        err = exc
        if up is not None:
            up.discard()
    reports = comm.agree(_local(err, job.step), "put: sealed", report)
    def commit() -> StepInfo:
        try:
            return _commit(ds, job, reports)
        except Exception as exc:  # as a single-process put: WriteFailed, cause kept
            local = _local(exc, job.step)
            if local is exc or local is None:
                raise
            raise local from exc

    info = comm.from_coordinator("put: commit", commit, scatter=False)
    root = bytes.fromhex(info.root)
    for _, _, p in job.plans:
        p.state.anchor = (root_name(job.step), root)
    return dataclasses.replace(info, stall_seconds=job.stall)


def _commit(ds: DistributedStore, job: Step, reports: list) -> StepInfo:
    """On the coordinator: adopt the ranks' records, build the nodes, commit the step."""
    t0 = time.perf_counter()
    objects = ds.local.objects
    opt = ds.options
    R = opt.rows
    slots: dict[str, dict[int, list]] = {}
    changed: dict[str, int] = {}
    written: dict[str, int] = {}
    for _, sl, ch, _ in reports:
        for (n, b0), s in sl.items():
            slots.setdefault(n, {})[b0] = s
        for n, (c, w) in ch.items():
            changed[n] = changed.get(n, 0) + c
            written[n] = written.get(n, 0) + w
    w = objects.writer(timeout=opt.lock_timeout)
    try:
        commit_check(objects, job.step)()
        ensure_stored(objects, w, opt)
        transfer.adopt(w, [r[0] for r in reports])  # counted in w's bytes from here on
        table_ids = []
        logical = 0
        for name, gt in job.tables.items():
            dtype = gt.torch_dtype
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
        _point("dist.coord_before_commit")
        node = StepNode(step=job.step, time=time.time(), tables=tuple(job.tables),
                        table_ids=tuple(table_ids), metadata=job.metadata,
                        logical_bytes=logical, bytes_new=w.payload_bytes_new,
                        rows_changed={n: changed.get(n, 0) for n in job.tables},
                        state=job.state)
        payload, refs = node.encode()
        root = w.put(KIND_STEP, payload, refs, meta=True)
        bytes_new = w.payload_bytes_new
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
    _point("dist.coord_after_commit")
    return StepInfo(
        step=job.step, root=root.hex(), bytes_written=commit.bytes_written,
        logical_bytes=logical, rows_changed=dict(node.rows_changed),
        rows_written={n: written.get(n, 0) for n in job.tables},
        objects_new=commit.objects_new, objects_reused=commit.objects_reused,
        bytes_new=bytes_new, stall_seconds=job.stall,
        rewritten_blocks=sum(r[3] for r in reports),
        write_seconds=time.perf_counter() - t0,
        tables={n: tid.hex() for n, tid in zip(job.tables, table_ids)},
    )

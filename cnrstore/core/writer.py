"""The background writer: turns table plans into engine objects and commits steps in order.

One thread owns all engine writes of a store handle, so steps commit in the order they were
put and each put's patches find their base blocks already written (docs/ARCHITECTURE.md,
"A put and a get", steps 3-5). At most ``max_inflight`` puts wait or run; a further put
blocks in ``submit`` (back-pressure, so host memory for pending codes stays bounded). One
engine write transaction per step: objects, then the step root, then commit.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from cnrstore.codec.cores import start_thread
from cnrstore.core.blockplan import FULL, GROUPED, TablePlan
from cnrstore.core.groupwrite import write_fresh, write_grouped
from cnrstore.core.tablestate import TableState, dtype_name
from cnrstore.errors import StepExists, WriteFailed
from cnrstore.format.blocks import encode_full, encode_patch, plane_width
from cnrstore.format.manifest import (
    KIND_BLOCK_FULL,
    KIND_BLOCK_PATCH,
    KIND_SEGMENT,
    KIND_STEP,
    KIND_TABLE,
    SegmentNode,
    StepNode,
    TableNode,
    root_name,
)
from engine import ObjectStore, RootExists, StoreError, Writer, object_id

T = TypeVar("T")

__all__ = ["StepInfo", "BackgroundWriter", "write_step", "write_blocks", "write_nodes", "BaseGone"]


@dataclass(frozen=True)
class StepInfo:
    """What a put wrote. ``bytes_written`` counts record bytes the engine appended (after
    compression); ``bytes_new`` the uncompressed payload bytes of new objects."""

    step: int
    root: str                       # hex id of the step node
    bytes_written: int
    logical_bytes: int              # sum of the put tables' sizes
    rows_changed: dict[str, int] = field(default_factory=dict)   # rows differing from the base
    objects_new: int = 0
    objects_reused: int = 0
    bytes_new: int = 0
    rows_written: dict[str, int] = field(default_factory=dict)   # incl. rest of full blocks
    stall_seconds: float = 0.0      # time put_tables held the caller (fingerprint+encode+copy)
    write_seconds: float = 0.0      # time the writer spent encoding blocks and committing
    tables: dict[str, str] = field(default_factory=dict)   # name -> hex id of its table node
    # Blocks written in full because their diff base could not be read (damaged) or was
    # gone under the writer lock (gc by another process): never a failed put (issue 8).
    rewritten_blocks: int = 0


class _MissingBase(Exception):
    pass


class BaseGone(WriteFailed):
    """A put's diff base was gone under the writer lock and the put kept no full codes to
    write the blocks in full (a gc in another process dropped a step the put did not take
    to be at risk, e.g. ``gc(keep=[older])`` dropping the newest step). A blocking put
    retries with full codes kept (CheckpointStore._put)."""


def _readable(get, oid: bytes) -> bool:
    try:
        get(oid)
    except StoreError:
        return False
    return True


def _write_full(w, get, plan: TablePlan, slot, codes, elem: int, index: int) -> None:
    """A full block; for a block whose stored base was damaged, never one that dedups onto
    a damaged record of the same content (same content, same id): that one is written as
    a patch replacing every row of a filler block, which has another id."""
    payload = encode_full(codes, elem=elem)
    if index not in plan.damaged_blocks:
        slot.oid = w.put(KIND_BLOCK_FULL, payload)
        return
    plan.rewritten_blocks += 1
    oid = object_id(KIND_BLOCK_FULL, (), payload)
    if not w.has(oid) or _readable(get, oid):
        slot.oid = w.put(KIND_BLOCK_FULL, payload)
        return
    for fill in range(4):
        filler = np.full(codes.shape, fill, dtype=np.uint8)
        if np.array_equal(filler, codes):
            continue
        fpayload = encode_full(filler, elem=elem)
        fid = object_id(KIND_BLOCK_FULL, (), fpayload)
        if not w.has(fid) or _readable(get, fid):
            break
    base = w.put(KIND_BLOCK_FULL, fpayload)
    patch = encode_patch(slot.nrows, np.arange(slot.nrows), codes, elem=elem)
    slot.oid = w.put(KIND_BLOCK_PATCH, patch, (base,))
    slot.depth, slot.chain_bytes = 1, len(patch)
    slot.set_unknown()  # a chain on a filler: never merged onto it


def _write_table(w, plan: TablePlan, get) -> bytes:
    write_blocks(w, plan, get)
    return write_nodes(w, plan.name, plan.state)


def write_blocks(w, plan: TablePlan, get) -> None:
    """Put the blocks ``plan`` writes and fill every slot's id (``w`` needs ``put`` and
    ``has``: an engine Writer, or a rank's collector in a distributed put)."""
    plan.encoded()  # a non-blocking put's rows are encoded here, on the writer thread
    state = plan.state
    elem = plane_width(state.scheme, state.dtype.itemsize, state.row_nbytes)
    for bw in plan.writes:
        slot = state.slots[bw.index]
        assert slot is not None  # plan_table gives every block of a new state a slot
        codes = plan.codes[bw.start:bw.stop]
        if bw.kind == GROUPED:
            if not write_grouped(w, plan, slot, bw, codes, elem):
                raise _MissingBase(f"table {plan.name!r} block {bw.index}: a listed row "
                                   "object is missing (an earlier put failed or gc dropped it)")
        elif bw.kind == FULL:
            _write_full(w, get, plan, slot, codes, elem, bw.index)
        else:
            assert plan.base_slots is not None and bw.rows is not None  # a patch has both
            # A merged patch's base is its chain's full block (snapshot.BlockWrite.base).
            base = bw.base if bw.base is not None else plan.base_slots[bw.index]
            if (base.oid is None or not w.has(base.oid)) and plan.full_codes is not None:
                # Checked under the writer lock: gc in another process dropped the base
                # after the put was planned. Write the block in full instead.
                start = bw.index * state.block_rows
                full = plan.full_codes[start:start + slot.nrows]
                slot.oid = w.put(KIND_BLOCK_FULL, encode_full(full, elem=elem))
                slot.set_full()
                plan.rewritten_blocks += 1
                continue
            if base.oid is None or not w.has(base.oid):
                raise _MissingBase(
                    f"table {plan.name!r} block {bw.index}: base block is missing "
                    "(an earlier put failed or gc dropped it)"
                )
            slot.oid = w.put(
                KIND_BLOCK_PATCH, encode_patch(slot.nrows, bw.rows, codes, elem=elem), (base.oid,)
            )
    # Reused blocks need no lookup here: putting a new segment makes the engine check that
    # every block it refers to exists, and an existing segment implies its blocks exist.
    # Unless the base may have vanished (full codes kept): then each is checked.
    written = {bw.index for bw in plan.writes}
    for i, maybe in enumerate(state.slots):
        assert maybe is not None
        slot = maybe
        if plan.full_codes is not None and i not in written and (
            slot.oid is None or not w.has(slot.oid)
        ):
            # In place: a put planned meanwhile on this state shares the slot object, and
            # the new full block decodes to what the lost one did.
            start = i * state.block_rows
            full = plan.full_codes[start:start + slot.nrows]
            if plan.layout == "grouped":
                write_fresh(w, plan, slot, full, elem)
                continue
            slot.oid = w.put(KIND_BLOCK_FULL, encode_full(full, elem=elem))
            slot.set_full()
            plan.rewritten_blocks += 1
        if slot.oid is None:
            raise _MissingBase(f"table {plan.name!r} block {i} refers to a missing block")


def write_nodes(w, name: str, state: TableState) -> bytes:
    """Put the segment nodes and the table node of ``state`` (every slot's id filled);
    return the table node's id. The same nodes, so the same ids, for the same slots."""
    slots = [s for s in state.slots if s is not None]
    oids = [s.oid for s in slots if s.oid is not None]
    if len(oids) != len(state.slots):
        raise _MissingBase(f"table {name!r} refers to a missing block")
    seg_ids = []
    fan = state.fanout
    for j in range(0, len(state.slots), fan):
        part = slots[j:j + fan]
        ids = tuple(oids[j:j + fan])
        k = j // fan
        cached = state.segments[k] if k < len(state.segments) else None
        if cached is not None and cached[0] == ids and w.has(cached[1]):
            seg_ids.append(cached[1])
            continue
        node = SegmentNode(ids, tuple(s.depth for s in part), tuple(s.chain_bytes for s in part))
        payload, refs = node.encode()
        sid = w.put(KIND_SEGMENT, payload, refs, meta=True)
        seg_ids.append(sid)
    state.segments = [(tuple(oids[j:j + fan]), sid)
                      for j, sid in zip(range(0, len(state.slots), fan), seg_ids)]
    tnode = TableNode(
        name=name,
        shape=state.shape,
        dtype=dtype_name(state.dtype),
        scheme=state.scheme,
        block_rows=state.block_rows,
        fanout=fan,
        row_nbytes=state.row_nbytes,
        segment_ids=tuple(seg_ids),
    )
    payload, refs = tnode.encode()
    return w.put(KIND_TABLE, payload, refs, meta=True)


def write_step(
    objects: ObjectStore,
    step: int,
    plans: Sequence[TablePlan],
    *,
    metadata: dict,
    stall_seconds: float,
    lock_timeout: float | None,
    state: dict | None = None,
    check: Callable[[Writer], None] | None = None,
) -> StepInfo:
    """Write one step in one engine transaction; return its StepInfo. ``state`` is the
    structure of a put_state step; ``check(w)`` runs once the writer lock is held (another
    process may have committed meanwhile), may add to the transaction ``w``, and raises
    to refuse the step."""
    t0 = time.perf_counter()
    w = objects.writer(timeout=lock_timeout)
    try:
        if check is not None:
            check(w)
        table_ids = [_write_table(w, plan, objects.get) for plan in plans]
        node = StepNode(
            step=step,
            time=time.time(),
            tables=tuple(p.name for p in plans),
            table_ids=tuple(table_ids),
            metadata=metadata,
            logical_bytes=sum(p.logical_bytes for p in plans),
            bytes_new=w.payload_bytes_new,
            rows_changed={p.name: p.rows_changed for p in plans},
            state=state,
        )
        payload, refs = node.encode()
        root = w.put(KIND_STEP, payload, refs, meta=True)
        if any(p.borrowed is not None and p.borrowed.is_set() for p in plans):
            # Everything read from a borrowed table so far was read while its caller
            # waited; past this check nothing more is read, so the step holds the
            # values at call time, or is not committed.
            raise WriteFailed(step, "the caller stopped waiting (interrupted) before the "
                              "step was written; nothing was committed")
        bytes_new = w.payload_bytes_new
        # Create-only: the store's existence check ran before the writer lock, so another
        # handle or process may have put this step since; the engine re-checks at commit.
        w.create_root(root_name(step), root)
        commit = w.commit()
        for plan in plans:
            plan.state.anchor = (root_name(step), root)
    except RootExists:
        w.abort()
        raise StepExists(step) from None
    except _MissingBase as exc:
        w.abort()
        raise BaseGone(step, str(exc)) from None
    except BaseException:
        w.abort()
        raise
    return StepInfo(
        step=step,
        root=root.hex(),
        bytes_written=commit.bytes_written,
        logical_bytes=node.logical_bytes,
        rows_changed=dict(node.rows_changed),
        rows_written={p.name: len(p.codes) for p in plans},
        rewritten_blocks=sum(p.rewritten_blocks for p in plans),
        objects_new=commit.objects_new,
        objects_reused=commit.objects_reused,
        bytes_new=bytes_new,
        stall_seconds=stall_seconds,
        write_seconds=time.perf_counter() - t0,
        tables={p.name: tid.hex() for p, tid in zip(plans, table_ids)},
    )


class BackgroundWriter:
    """A single thread running jobs in submission order, with bounded queueing.

    A job counts against ``max_inflight`` from the moment it is in ``_jobs`` until the
    thread has finished it; the list itself is the count, so a KeyboardInterrupt landing
    anywhere in ``submit`` cannot leak a slot or give one back twice (a separate
    semaphore did both). ``queued(fut)`` tells a caller whose submit was interrupted
    whether its job will run.
    """

    def __init__(self, *, max_inflight: int):
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self._max = max_inflight
        self._cond = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._closed = False
        self._thread = start_thread(self._run, "cnrstore-writer")

    def submit(
        self, job: Callable[[], object], *, cleanup: Callable[[], None] | None = None,
        future: Future | None = None,
    ) -> Future:
        """Queue ``job``; blocks while ``max_inflight`` jobs are pending. Pass ``future``
        to learn through ``queued`` whether an interrupted submit still queued the job."""
        if self._closed:
            raise RuntimeError("writer is closed")
        if threading.current_thread() is self._thread:
            # e.g. a Future callback calling steps(): waiting on ourselves would hang forever
            raise RuntimeError("cannot queue store writes or waits from the writer thread")
        fut = Future() if future is None else future
        fut.set_running_or_notify_cancel()
        entry = [job, fut, cleanup]
        with self._cond:
            while len(self._jobs) >= self._max:
                self._cond.wait()
            # Notify first: the writer re-checks once we release the lock, so an interrupt
            # between the two lines can neither strand a queued job nor queue half of one.
            self._cond.notify_all()
            self._jobs.append(entry)  # one step: from here on the job runs
        return fut

    def queued(self, fut: Future) -> bool:
        """Whether ``fut``'s job was queued (it runs, or ran)."""
        with self._cond:
            return fut.done() or any(e[1] is fut for e in self._jobs)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                entry = self._jobs[0]
            job, fut, cleanup = entry
            if job is None:
                return
            error: BaseException | None = None
            result = None
            try:
                result = job()
            except BaseException as exc:  # surfaces on the Future, never kills the thread
                error = exc
            # Drop the job (and the host codes it holds) before waking the caller, so a
            # table-sized first put is not kept alive until the next job arrives, and the
            # caller's next put finds the staging buffer back in the pool.
            job = entry[0] = entry[2] = None
            if cleanup is not None:
                try:
                    cleanup()
                except BaseException as exc:  # never kill the thread: later waits would hang
                    error = error or exc
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            # Done before the slot frees, so queued(fut) never sees neither state.
            with self._cond:
                self._jobs.popleft()
                self._cond.notify_all()
            entry = fut = result = error = cleanup = None

    def run(self, job: Callable[[], T]) -> T:
        """Run ``job`` on the writer thread after everything queued before it; return its
        result or raise its error."""
        return self.submit(job).result()

    def drain(self) -> None:
        """Wait until every job submitted so far has finished."""
        if not self._closed:
            self.submit(lambda: None).result()

    def close(self) -> None:
        if self._closed:
            return
        self.drain()
        self._closed = True
        with self._cond:
            self._jobs.append([None, None, None])
            self._cond.notify_all()
        self._thread.join()

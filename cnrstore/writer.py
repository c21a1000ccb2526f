"""The background writer: turns table plans into engine objects and commits steps in order.

One thread owns all engine writes of a store handle, so steps commit in the order they were
put and each put's patches find their base blocks already written (DESIGN.md, "Data flow of
a put", steps 3-5). At most ``max_inflight`` puts wait or run; a further put blocks in
``submit`` (back-pressure, so host memory for pending codes stays bounded). One engine write
transaction per step: objects, then the step root, then commit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine import ObjectStore, RootExists

from .blocks import encode_full, encode_patch, plane_width
from .errors import StepExists, WriteFailed
from .manifest import (
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
from .snapshot import FULL, TablePlan
from .tablestate import dtype_name

__all__ = ["StepInfo", "BackgroundWriter", "write_step"]


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


class _MissingBase(Exception):
    pass


def _write_table(w, plan: TablePlan) -> bytes:
    state = plan.state
    elem = plane_width(state.scheme, state.dtype.itemsize, state.row_nbytes)
    for bw in plan.writes:
        slot = state.slots[bw.index]
        codes = plan.codes[bw.start:bw.stop]
        if bw.kind == FULL:
            slot.oid = w.put(KIND_BLOCK_FULL, encode_full(codes, elem=elem))
        else:
            base = plan.base_slots[bw.index]
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
    for i, slot in enumerate(state.slots):
        if slot.oid is None:
            raise _MissingBase(f"table {plan.name!r} block {i} refers to a missing block")
    seg_ids = []
    fan = state.fanout
    for j in range(0, len(state.slots), fan):
        part = state.slots[j:j + fan]
        ids = tuple(s.oid for s in part)
        k = j // fan
        cached = state.segments[k] if k < len(state.segments) else None
        if cached is not None and cached[0] == ids and w.has(cached[1]):
            seg_ids.append(cached[1])
            continue
        node = SegmentNode(ids, tuple(s.depth for s in part), tuple(s.chain_bytes for s in part))
        payload, refs = node.encode()
        sid = w.put(KIND_SEGMENT, payload, refs, meta=True)
        seg_ids.append(sid)
    state.segments = [(tuple(s.oid for s in state.slots[j:j + fan]), sid)
                      for j, sid in zip(range(0, len(state.slots), fan), seg_ids)]
    tnode = TableNode(
        name=plan.name,
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
) -> StepInfo:
    """Write one step in one engine transaction; return its StepInfo."""
    t0 = time.perf_counter()
    w = objects.writer(timeout=lock_timeout)
    try:
        table_ids = [_write_table(w, plan) for plan in plans]
        node = StepNode(
            step=step,
            time=time.time(),
            tables=tuple(p.name for p in plans),
            table_ids=tuple(table_ids),
            metadata=metadata,
            logical_bytes=sum(p.logical_bytes for p in plans),
            bytes_new=w.payload_bytes_new,
            rows_changed={p.name: p.rows_changed for p in plans},
        )
        payload, refs = node.encode()
        root = w.put(KIND_STEP, payload, refs, meta=True)
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
        raise WriteFailed(step, str(exc)) from None
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
        objects_new=commit.objects_new,
        objects_reused=commit.objects_reused,
        bytes_new=bytes_new,
        stall_seconds=stall_seconds,
        write_seconds=time.perf_counter() - t0,
    )


class BackgroundWriter:
    """A single thread running jobs in submission order, with bounded queueing."""

    def __init__(self, *, max_inflight: int):
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="cnrstore-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(
        self, job: Callable[[], object], *, cleanup: Callable[[], None] | None = None
    ) -> Future:
        """Queue ``job``; blocks while ``max_inflight`` jobs are pending."""
        if self._closed:
            raise RuntimeError("writer is closed")
        if threading.current_thread() is self._thread:
            # e.g. a Future callback calling steps(): waiting on ourselves would hang forever
            raise RuntimeError("cannot queue store writes or waits from the writer thread")
        self._slots.acquire()
        fut: Future = Future()
        fut.set_running_or_notify_cancel()
        self._queue.put((job, fut, cleanup))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fut, cleanup = item
            error: BaseException | None = None
            result = None
            try:
                result = job()
            except BaseException as exc:  # surfaces on the Future, never kills the thread
                error = exc
            # Drop the job (and the host codes it holds) before waking the caller, so a
            # table-sized first put is not kept alive until the next job arrives, and the
            # caller's next put finds the staging buffer back in the pool.
            item = job = None
            if cleanup is not None:
                cleanup()
            self._slots.release()
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
            fut = result = error = cleanup = None

    def run(self, job: Callable[[], object]) -> object:
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
        self._queue.put(None)
        self._thread.join()

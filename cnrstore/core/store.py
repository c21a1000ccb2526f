"""CheckpointStore: the public API of cnrstore (DESIGN.md, "Public API").

A store handle owns one background writer thread (all engine writes go through it, so
steps, deletes and gc happen in call order) and the diff base of every table it put or
restored. The API methods are thread-safe: one lock serializes them.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import engine
from cnrstore.core import lineage, maintenance, statestore
from cnrstore.core.options import Options as _Options
from cnrstore.core.options import positive as _positive
from cnrstore.core.seed import seed_state
from cnrstore.core.snapshot import HostBuffers, plan_table
from cnrstore.core.stateapi import StateMethods
from cnrstore.core.tablestate import TableState
from cnrstore.core.validate import (
    check_step,
    check_tables,
    check_touched,
    pack_metadata,
    resolve_quant,
)
from cnrstore.core.writer import BackgroundWriter, BaseGone, StepInfo, write_step
from cnrstore.errors import (
    CheckpointError,
    InvalidInput,
    InvalidType,
    StepExists,
    StepNotFound,
    StepOrderError,
    WriteFailed,
)
from cnrstore.format.manifest import list_steps, root_name
from engine import ObjectStore

__all__ = ["CheckpointStore", "open"]

# Handles still open at interpreter exit are closed then, so a non-blocking put that was
# never waited for is still committed (the writer thread is a daemon and would be killed).
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    for store in list(_OPEN):
        try:
            store.close()
        except Exception:  # exiting anyway; one broken store must not stop the others
            pass


class CheckpointStore(StateMethods):
    """Checkpoints of embedding tables over an engine object store.

    Use ``cnrstore.open(path)`` for a store on disk; construct directly over any
    ``engine.ObjectStore`` (e.g. ``engine.MemoryStore()``) for tests. Options:

    - ``block_rows`` (4096): rows per block, the unit of patching and of partial restores.
    - ``fanout`` (256): blocks per segment node.
    - ``max_chain`` (16): patches allowed above a full block before it is rewritten full.
    - ``max_inflight`` (2): non-blocking puts that may wait or run before a put blocks.
    - ``decode_threads``: threads decoding blocks on restore (default: CPU count, <= 8).
    - ``expected_restores`` (1): what ``quant="auto"`` bases its choice on.
    - ``seed_from_store`` (True): a table's first put in this handle diffs against the
      newest stored step holding it (same geometry), so it is incremental, not full.
    - ``lock_timeout`` (60 s): how long a write waits for another process's writer.
    - ``host_buffer_bytes`` (2 GiB): host staging buffers kept for reuse across puts.
    """

    def __init__(
        self,
        objects: ObjectStore,
        *,
        block_rows: int = 4096,
        fanout: int = 256,
        max_chain: int = 16,
        max_inflight: int = 2,
        decode_threads: int | None = None,
        expected_restores: int = 1,
        seed_from_store: bool = True,
        lock_timeout: float | None = 60.0,
        host_buffer_bytes: int = 2 << 30,
        owns_objects: bool = False,
    ):
        if not isinstance(objects, ObjectStore):
            raise InvalidType(f"objects must be an engine.ObjectStore, got {type(objects)}")
        threads = decode_threads or min(8, os.cpu_count() or 1)
        self._opt = _Options(
            block_rows=_positive("block_rows", block_rows),
            fanout=_positive("fanout", fanout),
            max_chain=_positive("max_chain", max_chain, lo=0),
            max_inflight=_positive("max_inflight", max_inflight),
            decode_threads=_positive("decode_threads", threads),
            expected_restores=_positive("expected_restores", expected_restores, lo=0),
            seed_from_store=bool(seed_from_store),
            lock_timeout=lock_timeout,
        )
        if block_rows > 1 << 31:
            raise InvalidInput("block_rows must fit in 32 bits")
        self._objects = objects
        self._owns = owns_objects
        self._lock = threading.RLock()
        self._states: dict[str, TableState] = {}
        self._pending: dict[int, Future] = {}
        self._failed = False
        self._buffers = HostBuffers(
            keep=max_inflight + 1,
            max_bytes=_positive("host_buffer_bytes", host_buffer_bytes, lo=0),
        )
        self._pool = ThreadPoolExecutor(self._opt.decode_threads, thread_name_prefix="cnr-decode")
        self._writer = BackgroundWriter(max_inflight=self._opt.max_inflight)
        self._closed = False
        self._pid = os.getpid()
        _OPEN.add(self)

    # -- lifetime ------------------------------------------------------------------------
    @property
    def objects(self) -> ObjectStore:
        """The engine store underneath (for inspection tools)."""
        return self._objects

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("store is closed")
        if os.getpid() != self._pid:
            raise CheckpointError("store handle used across fork(); open the store again")

    def close(self) -> None:
        """Wait for pending puts, stop the writer and close the engine store (if owned)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _OPEN.discard(self)
            if os.getpid() != self._pid:
                # A forked child: the writer thread and pool did not survive the fork, and
                # the parent owns the store; waiting on them here would hang forever.
                return
            self._writer.close()
            self._pool.shutdown(wait=True)
            self._states.clear()
            if self._owns:
                self._objects.close()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- put -----------------------------------------------------------------------------
    def put_tables(
        self,
        step: int,
        tables: Mapping,
        *,
        quant: str | Mapping[str, str] = "exact",
        metadata: Mapping | None = None,
        blocking: bool = True,
        touched: Mapping | None = None,
    ) -> StepInfo | Future:
        """Store ``tables`` (name -> tensor, rows = dim 0) as ``step``.

        Validates everything before writing anything (InvalidInput subclasses). Returns a
        StepInfo, or with ``blocking=False`` a Future of it once the tables were
        fingerprinted, encoded and copied to host memory (the caller may then modify them).
        ``touched`` optionally gives, per table, the row ids changed since this handle's
        last put of it (rows outside it are assumed unchanged). A failed write raises
        WriteFailed (on the Future when non-blocking). ``quant`` keys may be fnmatch
        patterns (cnrstore/core/quantspec.py); a step below the highest is StepOrderError.
        """
        return self._put(step, tables, quant=quant, metadata=metadata, blocking=blocking,
                         touched=touched)

    def _put(self, step, tables, *, quant, metadata, blocking, touched, state=None,
             keep_full=False):
        self._check_open()
        self._check_writable("put_tables")
        check_step(step)
        check_tables(tables)
        schemes = resolve_quant(quant, tables, expected_restores=self._opt.expected_restores)
        meta_doc = pack_metadata(metadata)
        rows_touched = check_touched(touched, tables)
        with self._lock:
            self._check_open()
            if self._failed:  # a background put failed: its diff base cannot be trusted
                self._states.clear()
                self._failed = False
            if step in self._pending or self._objects.root(root_name(step)) is not None:
                raise StepExists(step)
            lineage.check_order(self, step)
            t0 = time.perf_counter()
            plans = []
            try:
                roots: dict[str, bytes | None] = {}

                def root(name: str) -> bytes | None:  # one lookup per anchor step per put
                    if name not in roots:
                        roots[name] = self._objects.root(name)
                    return roots[name]

                newest: list[str] = []

                def at_risk(base: TableState | None) -> bool:
                    # A base on a step that will not be the newest when this put is written
                    # may be dropped by another process's gc before the writer holds the
                    # lock (issue 8); a base on a pending put has no anchor yet.
                    if base is None:
                        return False
                    if keep_full:
                        return True
                    anchor = base.anchor[0] if base.anchor else base.planned_root
                    # Even this handle's latest put is checked: another process may have put
                    # a newer step since, and a gc keeping that one drops ours (issue 8).
                    if not newest:
                        steps = list_steps(self._objects) + list(self._pending)
                        newest.append(root_name(max(steps)) if steps else "")
                    return anchor != newest[0]

                for name, table in tables.items():
                    base = self._states.get(name)
                    if base is not None:
                        base.revalidate(root, self._objects.has)
                    elif self._opt.seed_from_store:
                        base = self._seed_from_newest(name, table, schemes[name])
                    plans.append(
                        plan_table(
                            name,
                            table,
                            scheme=schemes[name],
                            base=base,
                            block_rows=self._opt.block_rows,
                            fanout=self._opt.fanout,
                            max_chain=self._opt.max_chain,
                            touched=rows_touched.get(name),
                            buffers=self._buffers,
                            keep_full=at_risk(base),
                        )
                    )
            except BaseException:
                for p in plans:
                    if p.release:
                        p.release()
                raise
            stall = time.perf_counter() - t0
            fut: Future = Future()
            try:
                self._writer.submit(
                    lambda: self._write(step, plans, meta_doc, stall, state),
                    cleanup=lambda: [p.release() for p in plans if p.release],
                    future=fut,
                )
            except BaseException:
                if not self._writer.queued(fut):
                    # Not queued (e.g. Ctrl-C while waiting for a writer slot): as for a
                    # refused put, the diff bases stay those of the last put.
                    for p in plans:
                        if p.release:
                            p.release()
                    raise
                self._queued(step, plans, fut)  # interrupted just after: it will be written
                raise
            self._queued(step, plans, fut)
        if not blocking:
            return fut
        try:
            return fut.result()
        except BaseGone:
            if keep_full:
                raise
        # A gc in another process swept the base this put diffed against. The caller's
        # tables are still as they were (the put blocks), so plan it again, keeping every
        # row's codes: blocks whose base is gone are then written in full. ``touched`` is
        # dropped: the failure cleared the bases it was relative to.
        return self._put(step, tables, quant=quant, metadata=metadata, blocking=True,
                         touched=None, state=state, keep_full=True)

    def _queued(self, step: int, plans, fut: Future) -> None:
        # The step will be written, so the next put diffs against it. A Ctrl-C while the
        # caller waits leaves it to finish; steps() tells whether it committed. A diff base
        # left on an older committed step stays correct (its blocks exist), only larger.
        for p in plans:
            self._states[p.name] = p.state
            p.state.planned_root = root_name(step)
        self._pending[step] = fut
        fut.add_done_callback(lambda f, s=step: self._pending.pop(s, None))

    def _write(self, step: int, plans, metadata: dict, stall: float, state=None) -> StepInfo:
        try:
            return write_step(
                self._objects,
                step,
                plans,
                metadata=metadata,
                stall_seconds=stall,
                lock_timeout=self._opt.lock_timeout,
                state=state,
                check=lineage.commit_check(self._objects, step),
            )
        except BaseException as exc:
            self._failed = True
            if isinstance(exc, (WriteFailed, StepOrderError, StepExists)):
                raise
            raise WriteFailed(step, f"{type(exc).__name__}: {exc}") from exc

    def _seed_from_newest(self, name: str, table, scheme: str) -> TableState | None:
        """Diff base for a table's first put in this handle, from the newest stored step that
        holds it with the same geometry and encoding (docs/MANIFEST.md, "Write rules")."""
        self._writer.drain()
        return seed_state(
            self._objects, name, table, scheme,
            block_rows=self._opt.block_rows, fanout=self._opt.fanout, pool=self._pool,
        )

    # -- get -----------------------------------------------------------------------------
    def _wait_step(self, step: int) -> None:
        fut = self._pending.get(step)
        if fut is not None:
            exc = fut.exception()
            if exc is not None:
                raise StepNotFound(step, f"step {step} was not written: {exc}") from exc

    def get_tables(
        self,
        step: int | None = None,
        *,
        names: Iterable[str] | None = None,
        rows: Mapping[str, slice] | None = None,
        device="cpu",
        out: Mapping | None = None,
    ) -> dict:
        """Tables of ``step`` (None: the highest step) as name -> tensor on ``device``, with
        the dtype and shape they were put with. ``names`` picks tables; ``rows`` maps a
        table name to a slice of its rows. ``out`` (name -> tensor) decodes into existing
        tensors in place, all shapes and dtypes checked before anything is written."""
        if out is not None:
            return statestore.get_into(self, step, out, names=names, rows=rows)
        return maintenance.get_tables(self, step, names=names, rows=rows, device=device)

    def metadata(self, step: int | None = None) -> dict:
        """The ``metadata`` mapping put with ``step`` (None: the highest step)."""
        return maintenance.metadata(self, step)

    def steps(self) -> list[int]:
        """Ascending list of the steps the store holds (waits for pending puts)."""
        self._check_open()
        self._writer.drain()
        return list_steps(self._objects)

    def delete_step(self, step: int) -> None:
        """Delete a step (its bytes are reclaimed by the next gc). Waits if it is pending."""
        self._check_writable("delete_step")
        maintenance.delete_step(self, step)

    def gc(
        self,
        keep_last: int | None = None,
        keep: Iterable[int] = (),
        *,
        threshold: float = 0.25,
    ) -> maintenance.GCReport:
        """Drop every step but the newest ``keep_last`` and those in ``keep`` (with neither
        given, none), then reclaim unreachable bytes. Returns a GCReport."""
        self._check_writable("gc")
        return maintenance.gc(self, keep_last, keep, threshold=threshold)

    def verify(self, *, deep: bool = True) -> maintenance.VerifyReport:
        """Check every step's manifest and blocks (deep: decode every block). VerifyReport."""
        return maintenance.verify(self, deep=deep)

    def stats(self) -> maintenance.StoreStats:
        """Logical vs stored bytes, objects and dedup ratio. StoreStats."""
        return maintenance.stats(self)

    def _check_writable(self, what: str) -> None:
        if getattr(self._objects, "readonly", False):
            raise InvalidInput(f"{what}: the store was opened with readonly=True")

    def __repr__(self) -> str:
        return f"CheckpointStore({self._objects!r}, block_rows={self._opt.block_rows})"


def open(  # noqa: A001 - the public name is cnrstore.open, like engine.open
    path: str | os.PathLike,
    *,
    create: bool = True,
    block_rows: int = 4096,
    fanout: int = 256,
    max_chain: int = 16,
    max_inflight: int = 2,
    decode_threads: int | None = None,
    expected_restores: int = 1,
    seed_from_store: bool = True,
    lock_timeout: float | None = 60.0,
    host_buffer_bytes: int = 2 << 30,
    compression_level: int = 1,
    readonly: bool = False,
) -> CheckpointStore:
    """Open (creating it if missing and ``create``) the checkpoint store at ``path``.
    ``compression_level`` is the engine's zstd level for new records: on element planes of
    fp32 rows level 1 compresses as well as level 3 (1.19x vs 1.17x measured) at twice the
    speed. ``readonly=True`` opens without the writer lock and writes nothing (a store
    whose files are not writable can still be read); put, delete and gc then raise
    InvalidInput. The other options are those of CheckpointStore."""
    objects = engine.open(path, create=create and not readonly,
                          compression_level=compression_level, readonly=readonly)
    try:
        return CheckpointStore(
            objects,
            block_rows=block_rows,
            fanout=fanout,
            max_chain=max_chain,
            max_inflight=max_inflight,
            decode_threads=decode_threads,
            expected_restores=expected_restores,
            seed_from_store=seed_from_store,
            lock_timeout=lock_timeout,
            host_buffer_bytes=host_buffer_bytes,
            owns_objects=True,
        )
    except BaseException:
        objects.close()
        raise

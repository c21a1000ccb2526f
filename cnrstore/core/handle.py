"""HandleState: the state a CheckpointStore owns, as one typed object.

The store's operations live in several modules (put.py, maintenance.py, statestore.py,
lineage.py, verify.py) so that each stays readable; they receive this object, never the
CheckpointStore, whose private fields only core/store.py touches (a test checks it).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from cnrstore.core.options import Options
from cnrstore.core.snapshot import HostBuffers
from cnrstore.core.tablestate import DeferredBase, TableState, cancel_deferred
from cnrstore.core.validate import check_step, check_writable
from cnrstore.core.writer import BackgroundWriter
from cnrstore.errors import CheckpointError, StepNotFound
from cnrstore.format.load import list_steps
from cnrstore.format.manifest import TableManifest
from engine import ObjectStore

__all__ = ["HandleState"]

T = TypeVar("T")


@dataclass(eq=False)
class HandleState:
    """Everything a store handle holds. ``lock`` serializes the API methods; ``writer`` runs
    every engine write in call order; ``states`` are the diff bases per table name."""

    objects: ObjectStore
    options: Options  # resolved: block_rows, fanout and decode_threads are set
    owns_objects: bool
    pool: ThreadPoolExecutor
    writer: BackgroundWriter
    buffers: HostBuffers
    lock: threading.RLock = field(default_factory=threading.RLock)
    states: dict[str, TableState] = field(default_factory=dict)
    pending: dict[int, Future] = field(default_factory=dict)
    last_root: str | None = None  # root of this handle's latest queued put
    # The put pipeline (core/put.py): a world of one (core/group.py Solo,
    # core/placement.py WholeTables, core/commit.py EngineCommit; set by CheckpointStore);
    # the get pipeline (core/get.py) reads through core/localread.py OwnStore.
    group: Any = None
    placement: Any = None
    commit: Any = None
    reader: Any = None
    closed: bool = False
    pid: int = field(default_factory=os.getpid)

    def check_open(self) -> None:
        if self.closed:
            raise CheckpointError("store is closed")
        if os.getpid() != self.pid:
            raise CheckpointError("store handle used across fork(); open the store again")

    def check_writable(self, what: str) -> None:
        check_writable(self.objects, what)

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if os.getpid() != self.pid:
                # A forked child: the writer thread and pool did not survive the fork, and
                # the parent owns the store; waiting on them here would hang forever.
                return
            self.writer.close()
            self.pool.shutdown(wait=True)
            cancel_deferred(self.objects)  # restored tables' diff bases still being read
            self.states.clear()
            if self.owns_objects:
                self.objects.close()

    def wait_step(self, step: int) -> None:
        """Wait for a pending put of ``step``; StepNotFound if it failed."""
        fut = self.pending.get(step)
        if fut is not None:
            exc = fut.exception()
            if exc is not None:
                raise StepNotFound(step, f"step {step} was not written: {exc}") from exc

    def resolve_step(self, step: int | None) -> int:
        """``step`` itself once it is written, or the highest step when None."""
        if step is None:
            self.writer.drain()
            steps = list_steps(self.objects)
            if not steps:
                raise StepNotFound(-1, "the store holds no steps")
            return steps[-1]
        check_step(step)
        self.wait_step(step)
        return step

    def latest(self, step: int | None, fn: Callable[[int], T]) -> T:
        """``fn(step)``; with ``step`` None, ``fn(highest step)``, resolved again when
        another handle or process deleted that step (rollback, gc) between resolving and
        reading it."""
        if step is not None:
            return fn(step)
        for attempt in range(16):
            resolved = self.resolve_step(None)
            try:
                return fn(resolved)
            except StepNotFound as exc:
                if exc.step != resolved or attempt == 15:
                    raise
        raise AssertionError("unreachable")

    def wants_seed(self, name: str) -> bool:
        """True when a restore of ``name`` should seed its diff base (none yet)."""
        with self.lock:
            return name not in self.states and not self.closed

    def seed(self, name: str, tm: TableManifest, fps: Any, codes: Any,
             anchor: tuple[str, bytes], deferred: DeferredBase | None = None) -> None:
        """Seed the diff base of a table this handle has no base of (docs/ARCHITECTURE.md,
        "A put and a get", Seeding: a restarted job's next put is incremental again; a table
        the handle put keeps its base).
        ``deferred``: the diff data is still being computed (seed.seed_later)."""
        if deferred is not None:
            state = TableState.from_manifest(tm, anchor=anchor, deferred=deferred)
            state.reader = self.objects.get
            with self.lock:
                if self.states.setdefault(name, state) is not state:
                    deferred.cancel()
            return
        if codes is not None:
            state = TableState.from_manifest(tm, seed_codes=torch.from_numpy(codes),
                                             anchor=anchor)
        else:
            state = TableState.from_manifest(tm, fingerprints=fps, anchor=anchor)
        state.reader = self.objects.get
        with self.lock:
            self.states.setdefault(name, state)

"""The per-table diff base a store handle keeps between puts (not stored; docs/MANIFEST.md,
"Diff base").

A ``TableState`` describes one table as of the handle's last put or restore: its
geometry and encoding, the row fingerprints (on the table's device) that the next put
compares against, and one ``BlockSlot`` per block. Each put builds a new state: slots of
unchanged blocks are shared with the previous state, changed blocks get new slots whose
``oid`` the background writer fills in when it writes them. Because the writer commits puts
in order, a later put's patches always find their base's id filled in, unless that earlier
put failed (then ``oid`` stays None and the dependent put fails too).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cnrstore.codec.cores import thread_pool
from cnrstore.format.manifest import TableManifest, dtype_name, parse_dtype

__all__ = ["BlockSlot", "DeferredBase", "PutOutcome", "TableState", "Undo", "cancel_deferred",
           "dtype_name", "parse_dtype"]


class BlockSlot:
    """One block of one table version: its object id (None until written) and the state
    of its patch chain.

    For merged patches (snapshot.py, "Long-run write policy") a slot also knows its
    chain's full block (``full``: that block's slot, whose id the writer may still be
    filling in; None for a full block itself) and the rows that differ from it:
    ``union`` (block-local, ascending int64) with ``fsig``, the fingerprints those rows
    had in the full block. ``union`` None: not known (a base seeded from the store, or
    a chain on a filler block): the block is then never merged, only rewritten full."""

    __slots__ = ("oid", "nrows", "depth", "chain_bytes", "full", "union", "fsig", "group")

    def __init__(self, nrows: int, depth: int = 0, chain_bytes: int = 0, oid: bytes | None = None,
                 *, full: BlockSlot | None = None, union: np.ndarray | None = None,
                 fsig: np.ndarray | None = None):
        self.oid = oid
        self.nrows = nrows
        self.depth = depth
        self.chain_bytes = chain_bytes
        self.full = full
        if union is None and depth == 0:
            union, fsig = _EMPTY, _EMPTY  # a full block: nothing differs from itself
        self.union = union
        self.fsig = fsig
        # The grouped layout's writer state of this version (grouppolicy.ListedVersion); None for
        # a chain, or a list not loaded yet (TableState.reader loads it).
        self.group: Any = None

    def set_full(self) -> None:
        """The slot now holds a full block (the writer rewrote it)."""
        self.depth = self.chain_bytes = 0
        self.full, self.union, self.fsig = None, _EMPTY, _EMPTY

    def set_unknown(self) -> None:
        """The slot's chain is not one this handle can merge (patches on a filler block)."""
        self.full, self.union, self.fsig = None, None, None

    def __repr__(self) -> str:
        oid = self.oid.hex()[:12] if self.oid else None
        return f"BlockSlot({oid}, nrows={self.nrows}, depth={self.depth})"


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


# One thread for all deferred diff bases: it works while the restored job starts up and
# leaves the other core to it; the next put waits for what it needs.
_SEEDER: ThreadPoolExecutor | None = None
_SEEDER_LOCK = threading.Lock()
# Unfinished deferred bases per store they read (id of its object store), so that closing
# the store stops them first, also those whose state was dropped (rollback) meanwhile.
_RUNNING: dict[int, set[DeferredBase]] = {}


def _reset_seeder() -> None:
    global _SEEDER
    _SEEDER = None  # a forked child has the object but not the thread


os.register_at_fork(after_in_child=_reset_seeder)


class DeferredBase:
    """The diff data of a restored table (fingerprints or seed codes), computed from the
    stored step off the restore path (seed.seed_later). ``compute(cancel)`` returns
    (fingerprints, seed codes, indices of blocks it could not read); ``cancel`` is a
    threading.Event it checks between blocks."""

    def __init__(self, compute: Callable[[threading.Event], tuple[Any, Any, set[int]]],
                 owner: object):
        global _SEEDER
        self._compute = compute
        self._cancel = threading.Event()
        key = id(owner)
        with _SEEDER_LOCK:
            if _SEEDER is None:
                _SEEDER = thread_pool(1, "cnrstore-seed")
            _RUNNING.setdefault(key, set()).add(self)
            self._future: Future = _SEEDER.submit(compute, self._cancel)
        self._future.add_done_callback(lambda _: self._forget(key))

    def _forget(self, key: int) -> None:
        with _SEEDER_LOCK:
            running = _RUNNING.get(key)
            if running is not None:
                running.discard(self)
                if not running:
                    del _RUNNING[key]

    def result(self) -> tuple[Any, Any, set[int]]:
        """Wait for the background computation (or run it here if it has not started); a
        failed or cancelled one runs again here once, and may raise."""
        if self._future.cancel():
            return self._compute(threading.Event())
        try:
            return self._future.result()
        except Exception:
            return self._compute(threading.Event())

    def cancel(self) -> None:
        """Stop the background computation and wait until it no longer reads the store."""
        self._cancel.set()
        if not self._future.cancel():
            try:
                self._future.result()
            except Exception:  # noqa: S110 - it was cancelled or failed: nothing to keep
                pass


def cancel_deferred(owner: object) -> None:
    """Stop every deferred base reading ``owner`` (an object store about to close)."""
    with _SEEDER_LOCK:
        running = list(_RUNNING.get(id(owner), ()))
    for d in running:
        d.cancel()


class PutOutcome:
    """Whether the put that planned some states committed: ``failed`` None while it is
    pending, then False or True (set on the writer thread before its Future is done)."""

    __slots__ = ("failed", "states")

    def __init__(self, states: list[TableState]):
        self.failed: bool | None = None
        self.states = states
        for st in states:
            st.outcome = self

    def settle(self, committed: bool) -> None:
        self.failed = not committed
        if committed:  # its states are trusted now: the way back to their bases is dropped
            for st in self.states:
                if st.undo is not None:
                    st.undo.clear()
                    st.undo = None
        self.states = []


class Undo:
    """How a state planned by a pending put goes back to its diff base, should that put
    fail: the base's slots and row count, and the fingerprints the base held for the rows
    this put changed (a few rows: never a copy of the base's fingerprints). ``base``:
    the base itself, kept whole (a deferred plan not made yet). The base's own put, while
    pending, and its Undo chain on."""

    __slots__ = ("slots", "rows", "changed", "was", "base", "base_outcome", "base_undo",
                 "damaged_blocks", "damaged_ids", "anchor", "cleared")

    def __init__(self, base: TableState, changed: np.ndarray | None):
        self.slots, self.rows, self.anchor = base.slots, base.rows, base.anchor
        self.damaged_blocks, self.damaged_ids = base.damaged_blocks, base.damaged_ids
        self.base: TableState | None = base if changed is None else None
        self.changed = self.was = None
        if changed is not None:
            assert base.fingerprints is not None
            fps = base.fingerprints
            self.changed = torch.from_numpy(np.ascontiguousarray(changed, dtype=np.int64))
            self.was = torch.index_select(fps, 0, self.changed.to(fps.device))
        pending = base.outcome is not None and base.outcome.failed is not False
        self.base_outcome = base.outcome if pending else None
        self.base_undo = base.undo if pending else None
        self.cleared = False

    def clear(self) -> None:
        self.cleared = True
        self.slots, self.changed, self.was, self.base, self.base_undo = [], None, None, None, None


@dataclass
class TableState:
    """Diff base of one table. ``fingerprints`` or ``seed_codes`` (not both) says how the next
    put finds changed rows: by fingerprint, or (seeded from a lossy restore, where the raw
    rows are unknown) by comparing the new rows' codes with the stored codes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    scheme: str
    block_rows: int
    fanout: int
    row_nbytes: int
    slots: list[BlockSlot | None]           # None: no usable base (write the block full)
    fingerprints: torch.Tensor | None = None    # int64[rows], on the table's device
    seed_codes: torch.Tensor | None = None      # uint8[rows, row_nbytes], on CPU
    # The writer's cache of segment ids: (block ids of the segment, segment id) per index.
    segments: list[tuple[tuple[bytes, ...], bytes] | None] = field(default_factory=list)
    # (root name, step node id) of a committed step that reaches every slot: while that
    # root is unchanged, gc cannot have dropped a slot's block. None while pending.
    anchor: tuple[str, bytes] | None = None
    # Blocks of a base seeded from the store that could not be read (damaged): written in
    # full by the next put, never as a reuse of the damaged record (issue 8).
    damaged_blocks: frozenset[int] = frozenset()
    # Their records that could not be read: a distributed put's rank, which cannot read
    # the store when it writes, is told these are there and unreadable.
    damaged_ids: frozenset[bytes] = frozenset()
    # Root name of the put that made this state (its anchor once committed).
    planned_root: str | None = None
    # A restored table's diff data, still being computed from the stored step (a restore
    # returns without it): materialize() puts it into fingerprints / seed_codes.
    deferred: DeferredBase | None = None
    # Reads the store a base was seeded from: a put of the grouped layout loads a
    # block's list from it (grouppolicy.load_group) the first time the block changes.
    reader: Callable[[bytes], Any] | None = None
    # Set once the writer thread has planned this state (a non-blocking put's deferred
    # plan, snapshot.py): until then its slots and fingerprints are not filled in, and a
    # put that diffs against it waits (``settle``). None: planned when made.
    planning: threading.Event | None = None
    # The put that planned this state (None: committed, seeded or restored), and how to go
    # back to its base if that put or one it was planned on fails (``trusted``).
    outcome: PutOutcome | None = None
    undo: Undo | None = None
    # The caller's touched rows of the next put are not relative to this base (the base of
    # a failed put, put back): that put compares every row.
    untracked: bool = False

    def trusted(self) -> TableState | None:
        """This state, or where a put it comes from failed, the base that put was planned
        on, as the last committed put left it: a failed put is as if it never happened, so
        the next put diffs as a handle that never tried it does (same ids). None: that base
        cannot be rebuilt (it had no fingerprints, or the table shrank): the next put
        seeds it from the store."""
        start, failed = self, False
        ops: list[Undo] = []
        outcome, undo = self.outcome, self.undo
        while outcome is not None and outcome.failed is not False:
            failed = failed or outcome.failed is True
            if undo is None or undo.cleared:
                return None if failed else self
            if undo.base is not None:
                start, ops = undo.base, []
                outcome, undo = start.outcome, start.undo
            else:
                ops.append(undo)
                outcome, undo = undo.base_outcome, undo.base_undo
        if not failed:
            return self
        if not ops:
            start.untracked = True
            return start
        if start.fingerprints is None:
            return None
        fp = start.fingerprints.clone()  # a put planned on ``start`` may still read it
        for u in ops:
            if u.changed is None or u.was is None:  # cleared meanwhile: never a wrong base
                return None
            fp.index_copy_(0, u.changed.to(fp.device), u.was.to(fp.device))
            fp = fp[:u.rows]
        last = ops[-1]
        return TableState(shape=(last.rows, *self.shape[1:]), dtype=self.dtype,
                          scheme=self.scheme, block_rows=self.block_rows, fanout=self.fanout,
                          row_nbytes=self.row_nbytes, slots=list(last.slots), fingerprints=fp,
                          damaged_blocks=last.damaged_blocks, damaged_ids=last.damaged_ids,
                          anchor=last.anchor, reader=self.reader, untracked=True)

    def settle(self) -> None:
        """Wait until the writer has planned this state (a deferred plan): its slots and
        fingerprints are then filled in, or, where that plan failed, it has no diff data
        and no slots (the next put writes every block full: never a wrong base)."""
        if self.planning is not None:
            self.planning.wait()

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def width(self) -> int:
        return math.prod(self.shape[1:])

    def compatible(
        self, shape: tuple[int, ...], dtype: torch.dtype, scheme: str, block_rows: int, fanout: int
    ) -> bool:
        """True when a new version of the table can reuse and patch this one's blocks."""
        return (
            tuple(shape[1:]) == tuple(self.shape[1:])
            and dtype == self.dtype
            and scheme == self.scheme
            and block_rows == self.block_rows
            and fanout == self.fanout
        )

    def has_diff(self) -> bool:
        return (self.fingerprints is not None or self.seed_codes is not None
                or self.deferred is not None)

    def materialize(self) -> None:
        """Wait for deferred diff data. Blocks of the stored step that could not be read
        get no slot (the put writes them full); if the data cannot be computed at all, the
        state keeps no diff data and the put writes every block full: never a wrong base."""
        deferred, self.deferred = self.deferred, None
        if deferred is None:
            return
        try:
            fps, codes, damaged = deferred.result()
        except Exception:
            self.fingerprints = self.seed_codes = None
            return
        self.fingerprints = fps
        self.seed_codes = None if codes is None else torch.from_numpy(codes)
        for i in damaged:
            self.slots[i] = None
        if damaged:
            self.damaged_blocks = self.damaged_blocks | frozenset(damaged)

    def revalidate(self, root, has) -> int:
        """Before diffing against this state: if its anchor step was deleted or replaced
        (by this or another process), forget the slots whose blocks the engine no longer
        holds, so they are written full. ``root(name)`` reads a root, ``has(oid)`` checks
        an object. Returns how many slots were dropped. Deferred diff data is waited for
        first (every put calls this before it diffs)."""
        self.materialize()
        if self.anchor is None or root(self.anchor[0]) == self.anchor[1]:
            return 0
        self.anchor = None  # checked now; the next put anchors its own state
        return self.drop_missing(has)

    def drop_missing(self, has) -> int:
        """Forget slots whose object the engine no longer holds (after gc or delete_step), so
        their blocks are written full next time. Returns how many were dropped."""
        dropped = 0
        for i, slot in enumerate(self.slots):
            if slot is not None and (slot.oid is None or not has(slot.oid)):
                self.slots[i] = None
                dropped += 1
        if dropped:
            self.segments = []
        return dropped

    @classmethod
    def from_manifest(
        cls,
        tm: TableManifest,
        *,
        fingerprints: torch.Tensor | None = None,
        seed_codes: torch.Tensor | None = None,
        anchor: tuple[str, bytes] | None = None,
        deferred: DeferredBase | None = None,
    ) -> TableState:
        """State of a stored table (seeding after a restore, or from the newest step)."""
        node = tm.node
        slots: list[BlockSlot | None] = []
        for i, (oid, depth, chain) in enumerate(zip(tm.block_ids, tm.depth, tm.chain_bytes)):
            start, stop = node.block_range(i)
            slots.append(BlockSlot(stop - start, depth, chain, oid))
        segments: list[tuple[tuple[bytes, ...], bytes] | None] = [
            (seg.block_ids, sid) for seg, sid in zip(tm.segments, node.segment_ids)
        ]
        return cls(
            shape=node.shape,
            dtype=parse_dtype(node.dtype),
            scheme=node.scheme,
            block_rows=node.block_rows,
            fanout=node.fanout,
            row_nbytes=node.row_nbytes,
            slots=slots,
            fingerprints=fingerprints,
            seed_codes=seed_codes,
            segments=segments,
            anchor=anchor,
            deferred=deferred,
        )

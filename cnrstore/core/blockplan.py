"""What a put writes of one table (``TablePlan``: its blocks and their codes), the block
decisions from the rows that changed (``block_writes``), and a plan made on the writer
thread from rows copied in the stall (``Deferred``). core/snapshot.py makes the plans."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.core.chainpolicy import block_key, next_slot, patch_fits
from cnrstore.core.hostcodes import HostBuffers
from cnrstore.core.tablestate import BlockSlot, TableState, Undo

__all__ = ["BlockWrite", "Deferred", "FULL", "PATCH", "GROUPED", "TablePlan", "block_cuts",
           "block_writes"]

FULL = 0
PATCH = 1
GROUPED = 2   # the grouped layout: new row objects and a list (BlockWrite.group)


@dataclass(frozen=True)
class BlockWrite:
    """One block to write: ``codes[start:stop]`` of the plan are its rows (all of them for a
    full block; those listed in ``rows``, block-local, for a patch)."""

    index: int
    kind: int
    start: int
    stop: int
    rows: np.ndarray | None     # block-local row indices of a patch
    base: BlockSlot | None = None   # a patch's base: the previous version, or (merged) the
                                    # chain's full block
    # GROUPED: the objects to write (a grouppolicy.GroupWrite; grouppolicy plans with
    # these types, so they cannot name its own)
    group: Any = None


@dataclass
class TablePlan:
    name: str
    state: TableState           # the new diff base; the writer fills its new slots' ids
    writes: list[BlockWrite]
    codes: np.ndarray           # uint8[k, row_nbytes] on the host
    rows_changed: int           # rows that differ from the diff base (all without one)
    logical_bytes: int
    base_slots: list | None = None  # the diff base's slots (patch bases), when compatible
    release: Callable[[], None] | None = None  # returns the host buffer to its pool
    # Blocks whose stored base could not be read (written full, never deduplicated onto
    # the damaged record), and how many blocks the writer wrote full for want of a base.
    damaged_blocks: frozenset[int] = frozenset()
    rewritten_blocks: int = 0
    # Codes of every row, kept when the diff base may vanish before the write (its anchor
    # step is not the newest, so another process's gc may drop it): blocks whose base or
    # reused id is gone under the writer lock are then written full from these.
    full_codes: np.ndarray | None = None
    # Set when ``codes`` borrow the caller's table (a blocking put): set again once the
    # caller stops waiting, after which the writer must not commit what it read.
    borrowed: threading.Event | None = None
    # A blocking put's first plan of a table: the table is fingerprinted on another thread
    # while it is encoded and written; the waiting caller stores the result (an interrupted
    # wait drops it). Until then the new state has no diff data, so a put planned
    # meanwhile writes every block full: never wrong.
    fingerprint_later: Callable[[], None] | None = None
    # A non-blocking put's changed rows, copied but not encoded yet (hostcodes.snapshot_rows):
    # ``encoded()`` fills ``codes`` on the writer thread, before any block is written.
    encode_later: Callable[[], np.ndarray] | None = None
    # A non-blocking tracker-driven put's plan, its rows copied but not planned yet
    # (``Deferred``): ``encoded()`` fills ``writes``, ``codes``, ``rows_changed`` and the
    # state's slots and fingerprints on the writer thread, before any block is written.
    plan_later: Callable[[], None] | None = None
    step: int = 0               # the put's step (the grouped layout's objects carry it)
    layout: str = "chains"

    def encoded(self) -> None:
        """Run a deferred plan and encode (once; a no-op for plans made when planned)."""
        if self.plan_later is not None:
            later, self.plan_later = self.plan_later, None
            later()
        if self.encode_later is not None:
            self.codes, self.encode_later = self.encode_later(), None


def block_cuts(changed: np.ndarray, nblocks: int, block_rows: int
               ) -> tuple[np.ndarray | None, list[int] | None]:
    """Per block, how many of the rows ``changed`` (ascending) fall in it, and where each
    block's rows start in ``changed`` (None, None when no row changed)."""
    if not len(changed):
        return None, None
    counts = np.bincount(changed // block_rows, minlength=nblocks)
    cuts = np.searchsorted(changed, np.arange(nblocks + 1, dtype=np.int64) * block_rows)
    return counts, cuts.tolist()


def block_writes(name: str, fp: torch.Tensor | None, changed: np.ndarray,
                 cbase: TableState | None, rows: int, dtype: torch.dtype, width: int,
                 scheme: str, rnb: int, block_rows: int, max_chain: int, block_offset: int
                 ) -> tuple[list[BlockSlot | None], list[BlockWrite], list, int]:
    """(the new slots, the writes, the rows each write takes, ascending: (start, stop) of
    a full block or table row ids, and how many rows they are) of a table whose rows
    ``changed`` (ascending) differ from its diff base ``cbase`` (None: every block full);
    ``fp``: the new fingerprints (None: not known yet, a first put)."""
    nblocks = -(-rows // block_rows)
    counts, cuts = block_cuts(changed, nblocks, block_rows)
    new_fp = old_fp = None
    if len(changed) and fp is not None:
        sel = torch.from_numpy(changed)
        new_fp = fp[sel.to(fp.device)].cpu().numpy()
        if cbase is not None and cbase.fingerprints is not None:
            old_fp = cbase.fingerprints[sel.to(cbase.fingerprints.device)].cpu().numpy()
        elif cbase is not None and cbase.seed_codes is not None and scheme == "exact":
            # Seeded from stored codes: exact codes are the rows' bytes.
            prev = cbase.seed_codes[sel].view(dtype).reshape(len(sel), width)
            old_fp = row_fingerprints(prev).numpy()
    slots: list[BlockSlot | None] = []
    writes: list[BlockWrite] = []
    parts: list = []   # rows to encode, ascending: (start, stop) of a full block, or ids
    pos = 0
    for i in range(nblocks):
        start = i * block_rows
        nr = min(start + block_rows, rows) - start
        old = cbase.slots[i] if cbase is not None and i < len(cbase.slots) else None
        if old is not None and old.nrows == nr:
            k = int(counts[i]) if counts is not None else 0
            if k == 0:
                slots.append(old)
                continue
            assert new_fp is not None and cuts is not None  # rows changed: fingerprints
            lo, hi = cuts[i], cuts[i + 1]
            slot, local, pbase = next_slot(
                old, block_key(name, block_offset + i), changed[lo:hi] - start,
                None if old_fp is None else old_fp[lo:hi], new_fp[lo:hi], rnb, max_chain)
        else:
            slot, local, pbase = BlockSlot(nr), None, None
        slots.append(slot)
        if local is None:
            parts.append((start, start + nr))
            writes.append(BlockWrite(i, FULL, pos, pos + nr, None))
        else:
            parts.append(local + start)
            writes.append(BlockWrite(i, PATCH, pos, pos + len(local), local, pbase))
        pos += writes[-1].stop - writes[-1].start
    return slots, writes, parts, pos


class Deferred:
    """The plan of one exact CPU table for a non-blocking put that knows its touched rows
    (a tracker's), made on the writer thread (issue 26: at a checkpoint every 100 steps
    the stall was planning the 24-42 k rows a rank's tracker saw on the caller's thread).

    The caller's thread copies only what the step must hold, into a host buffer the plan
    owns: the touched rows (one index_select) and every block the plan may write whole
    or merged, one the chain policy cannot take as a patch of all its touched rows
    (``patch_fits``: it grows with the rows, so such a patch also fits whichever of them
    changed, and needs no other row). The writer then fingerprints the copied rows, finds
    those that changed, runs the chain policy and gathers the codes
    (``TablePlan.encoded``): the plan made at once, so the same bytes and ids. The new
    state is filled in then; a put that diffs against it first waits for that
    (``TableState.settle``)."""

    def __init__(self, name: str, x: torch.Tensor, table: torch.Tensor, cbase: TableState,
                 touched: torch.Tensor, rnb: int, block_rows: int, fanout: int,
                 max_chain: int, block_offset: int, buffers: HostBuffers):
        rows, width = x.shape
        self.name, self.cbase, self.rnb, self.dtype = name, cbase, rnb, x.dtype
        self.block_rows, self.max_chain, self.block_offset = block_rows, max_chain, block_offset
        self.buffers = buffers
        self.t = torch.unique(touched[touched < rows]).to("cpu")
        self.tn = self.t.numpy()
        nblocks = -(-rows // block_rows)
        counts = np.bincount(self.tn // block_rows, minlength=nblocks)
        self.whole: dict[int, int] = {}  # block -> its first row in the copy
        n = len(self.tn)
        for i in range(nblocks):
            start = i * block_rows
            nr = min(start + block_rows, rows) - start
            old = cbase.slots[i] if i < len(cbase.slots) else None
            k = int(counts[i])
            if old is not None and old.nrows == nr and (k == 0 or patch_fits(
                    old, block_key(name, block_offset + i), k, rnb, max_chain)):
                continue
            self.whole[i] = n
            n += nr
        self.copy_buf: torch.Tensor | None = None   # the rows copied in the stall
        self.codes_buf: torch.Tensor | None = None  # the codes gathered from them
        self.copy = torch.empty((0, width), dtype=x.dtype)
        if n:
            nbytes = n * width * x.element_size()
            self.copy_buf = buffers.take(nbytes, pinned=False)
            self.copy = self.copy_buf[:nbytes].view(x.dtype).view(n, width)
            if len(self.tn):
                torch.index_select(x, 0, self.t, out=self.copy[:len(self.tn)])
            for i, at in self.whole.items():
                start = i * block_rows
                nr = min(start + block_rows, rows) - start
                self.copy[at:at + nr].copy_(x[start:start + nr])
        self.state = TableState(
            shape=tuple(table.shape), dtype=table.dtype, scheme="exact",
            block_rows=block_rows, fanout=fanout, row_nbytes=rnb, slots=[None] * nblocks,
            segments=list(cbase.segments), planning=threading.Event())
        self.state.undo = Undo(cbase, None)  # until planned: the base itself
        self.plan = TablePlan(name, self.state, [], np.zeros((0, rnb), dtype=np.uint8), 0,
                              table.numel() * table.element_size(), cbase.slots,
                              self.release)
        self.plan.plan_later = self.complete
        if cbase.damaged_blocks:
            self.plan.damaged_blocks = frozenset(i for i in cbase.damaged_blocks
                                                 if i < nblocks)

    def complete(self) -> None:
        """Plan from the copy (on the writer thread); a failure leaves the state with no
        diff data, which the next put writes full."""
        try:
            self._plan()
        except BaseException:
            self._unplanned()
            raise
        finally:
            assert self.state.planning is not None
            self.state.planning.set()

    def _plan(self) -> None:
        cbase, t, copy, R = self.cbase, self.t, self.copy, self.block_rows
        assert cbase.fingerprints is not None
        rows, width = self.state.rows, self.state.width
        nt = len(t)
        fp = cbase.fingerprints.clone()
        now = row_fingerprints(copy[:nt]) if nt else fp[:0]
        fp.index_copy_(0, t, now)
        was = torch.index_select(cbase.fingerprints, 0, t)
        changed = t[now != was].numpy()
        slots, writes, parts, pos = block_writes(
            self.name, fp, changed, cbase, rows, self.dtype, width, "exact", self.rnb, R,
            self.max_chain, self.block_offset)
        src: list[np.ndarray] = []
        for bw, part in zip(writes, parts):
            at = self.whole.get(bw.index)
            if at is None and isinstance(part, tuple):
                raise AssertionError(f"put: table {self.name!r} block {bw.index} is written "
                                     "full and was not copied (a bug: report it)")
            if at is not None:
                local = (np.arange(part[1] - part[0], dtype=np.int64)
                         if isinstance(part, tuple) else part - bw.index * R)
                src.append(local + at)
            else:
                src.append(np.searchsorted(self.tn, part))  # changed rows are touched rows
        codes = np.zeros((0, self.rnb), dtype=np.uint8)
        if pos:
            nbytes = pos * self.rnb
            self.codes_buf = buf = self.buffers.take(nbytes, pinned=False)
            torch.index_select(copy, 0, torch.from_numpy(np.concatenate(src)),
                               out=buf[:nbytes].view(self.dtype).view(pos, width))
            codes = buf[:nbytes].numpy().reshape(pos, self.rnb)
        self.copy = copy[:0]
        if self.copy_buf is not None:  # read: back to the pool before the blocks are written
            self.buffers.give(self.copy_buf)
            self.copy_buf = None
        self.plan.writes, self.plan.codes, self.plan.rows_changed = writes, codes, len(changed)
        self.state.slots, self.state.fingerprints = slots, fp
        if self.state.outcome is None or self.state.outcome.failed is None:
            self.state.undo = Undo(cbase, changed)  # the rows this plan changed, not the base

    def _unplanned(self) -> None:
        self.state.slots = [None] * len(self.state.slots)
        self.state.fingerprints = None

    def release(self) -> None:
        """Give the buffers back; a plan never made (its put failed before the writer
        ran it) leaves its state with no diff data, and no put waits for it."""
        assert self.state.planning is not None
        if not self.state.planning.is_set():
            self.plan.plan_later = None
            self._unplanned()
            self.state.planning.set()
        for buf in (self.copy_buf, self.codes_buf):
            if buf is not None:
                self.buffers.give(buf)
        self.copy_buf = self.codes_buf = None

"""What a put writes of one table (``TablePlan``: its blocks and their codes) and the block
decisions from the rows that changed (``block_writes``). core/snapshot.py makes the plans
(core/writerplan.py those made on the writer thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.core.chainpolicy import block_key, next_slot
from cnrstore.core.tablestate import BlockSlot, TableState

__all__ = ["BlockWrite", "FULL", "PATCH", "GROUPED", "TablePlan", "block_cuts",
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
    # (core/writerplan.py): ``encoded()`` fills ``writes``, ``codes``, ``rows_changed`` and the
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

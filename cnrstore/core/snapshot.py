"""The on-device part of a put: find changed rows, plan blocks, gather + encode, copy to host.

This is the training stall of a put (docs/ARCHITECTURE.md, "A put and a get", steps 1-2). It runs on
the table's own device and changes nothing in the store or the handle: it returns a
``TablePlan`` (host codes of exactly the rows to write, plus the block plan and the new
diff base), which the background writer turns into objects. A plan raises before anything
changes, so a refused put leaves the diff base as it was.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from cnrstore.codec.cores import thread_pool
from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.codec.fpdiff import fingerprints_and_changes
from cnrstore.codec.quantize import (
    NeedsWideQparams,
    decode_rows,
    first_nonfinite_row,
    is_wide,
    row_nbytes,
)
from cnrstore.core.chainpolicy import block_key, next_slot
from cnrstore.core.grouppolicy import Group, GroupWrite, fresh_group, load_group, next_group
from cnrstore.core.hostcodes import HostBuffers, encode_checked, gather_encode, snapshot_rows
from cnrstore.core.tablestate import BlockSlot, TableState
from cnrstore.errors import CheckpointError, NonFiniteValues
from engine import StoreError

__all__ = ["BlockWrite", "TablePlan", "HostBuffers", "plan_table", "FULL", "PATCH", "GROUPED"]

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
    group: GroupWrite | None = None  # GROUPED: the objects to write


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
    step: int = 0               # the put's step (the grouped layout's objects carry it)
    layout: str = "chains"

    def encoded(self) -> None:
        """Run a deferred encode (once; a no-op for plans encoded when planned)."""
        if self.encode_later is not None:
            self.codes, self.encode_later = self.encode_later(), None


_FP_POOL: ThreadPoolExecutor | None = None
_FP_LOCK = threading.Lock()


def _fp_pool() -> ThreadPoolExecutor:
    """One thread fingerprinting first puts' tables while the caller encodes them."""
    global _FP_POOL
    with _FP_LOCK:
        if _FP_POOL is None:
            _FP_POOL = thread_pool(1, "cnrstore-fp")
        return _FP_POOL


def _as_rows(table: torch.Tensor) -> torch.Tensor:
    """The table as [rows, width] (a 1-D table has width 1)."""
    return table.detach().reshape(table.shape[0], math.prod(table.shape[1:]))


def _changed_old_rows(
    name: str, x: torch.Tensor, fp: torch.Tensor, base: TableState, common: int, scheme: str,
    wide: bool,
) -> np.ndarray:
    """Ascending ids of rows < common that differ from a diff base seeded from stored
    codes (a base with fingerprints is diffed by fingerprints_and_changes)."""
    if scheme != "exact" and common:
        bad = first_nonfinite_row(x[:common])
        if bad is not None:
            raise NonFiniteValues(name, bad, scheme)
    codes = encode_checked(name, x[:common], scheme, wide, None)
    assert base.seed_codes is not None  # a base has fingerprints or seed codes
    seed = base.seed_codes[:common].to(codes.device)
    if codes.shape[1]:
        mask = (codes != seed).any(dim=1)
    else:
        mask = torch.zeros(common, dtype=torch.bool, device=fp.device)
    if scheme != "exact":
        _keep_restored_rows(mask, x, fp, seed, scheme)
    return torch.nonzero(mask).flatten().cpu().numpy()


def _keep_restored_rows(
    mask: torch.Tensor, x: torch.Tensor, fp: torch.Tensor, seed: torch.Tensor, scheme: str
) -> None:
    """Clear ``mask`` for rows that still hold exactly what their seed codes decode to: a
    job resumed from restored values has not changed them, even where re-encoding those
    values gives other codes (fp16/bf16 tables under intN), and rewriting them would both
    cost bytes and re-quantize values already quantized."""
    cand = torch.nonzero(mask).flatten()
    if not len(cand) or not x.shape[1]:
        return
    decoded = decode_rows(seed[cand.to(seed.device)], scheme, x.dtype, x.shape[1])
    same = row_fingerprints(decoded.to(fp.device)) == fp[cand.to(fp.device)]
    mask[cand[same.to(cand.device)]] = False


def _group_of(old: BlockSlot, base: TableState | None, row_nbytes: int
              ) -> tuple[Group | None, int]:
    """(the grouped writer state of ``old``, 1 if its stored list could not be read):
    loaded from the store the base was seeded from when the handle has none. None: not
    a list (a chain of the other layout) or unreadable; the block is then written fresh."""
    if old.group is not None:
        return old.group, 0
    if base is None or base.reader is None or old.oid is None:
        return None, 0
    try:
        old.group = load_group(base.reader, old.oid, old.nrows, row_nbytes)
    except (StoreError, CheckpointError):
        return None, 1
    return old.group, 0


def plan_table(name: str, table: torch.Tensor, *, scheme: str, base: TableState | None,
               wide: bool | None = None, **kwargs) -> TablePlan:
    """Plan the put of one table against its diff base (None: all blocks full).
    ``keep_full``: also keep every row's codes (TablePlan.full_codes). ``borrow``: the
    caller waits for the write (a blocking put), so a whole exact table need not be
    copied: the plan's codes are a view of it (TablePlan.borrowed). ``defer_encode``:
    the caller does not wait (a non-blocking put), so intN rows are only copied here and
    encoded on the writer thread (TablePlan.encode_later): the stall is the copy.

    intN tables are encoded with fp16 scale/offset until a row needs fp32 ones (values
    beyond +-65504, docs/QUANTIZATION.md "Wide rows"); then the whole table is re-encoded
    wide, and stays wide while its diff base is. ``wide=True`` encodes wide from the
    start (a distributed put whose other part of the table needed it). ``block_offset``:
    the index in the whole table of the first block (a rank's part of a distributed
    put), which the chain policy spreads bounds by (chainpolicy.py)."""
    width = math.prod(table.shape[1:])
    if wide is None:
        wide = (
            base is not None and base.scheme == scheme and base.dtype == table.dtype
            and is_wide(scheme, table.dtype, width, base.row_nbytes)
        )
    try:
        return _plan_table(name, table, scheme=scheme, base=base, wide=wide, **kwargs)
    except NeedsWideQparams:
        return _plan_table(name, table, scheme=scheme, base=base, wide=True, **kwargs)


def _plan_table(
    name: str,
    table: torch.Tensor,
    *,
    scheme: str,
    base: TableState | None,
    wide: bool,
    block_rows: int,
    fanout: int,
    max_chain: int,
    block_offset: int = 0,
    touched: torch.Tensor | None = None,
    buffers: HostBuffers | None = None,
    keep_full: bool = False,
    borrow: bool = False,
    defer_encode: bool = False,
    layout: str = "chains",
    step: int = 0,
) -> TablePlan:
    x = _as_rows(table)
    rows, width = x.shape
    rnb = row_nbytes(scheme, table.dtype, width, wide=wide)
    cbase = base if (
        base is not None
        and base.has_diff()
        and base.compatible(tuple(table.shape), table.dtype, scheme, block_rows, fanout)
        and base.row_nbytes == rnb
    ) else None  # the diff base, when this put can diff against it
    compatible = cbase is not None
    common = min(rows, cbase.rows) if cbase is not None else 0

    if cbase is not None and touched is not None and cbase.fingerprints is not None:
        # The caller tracked the touched rows: hash only those (and any new rows).
        t = torch.unique(touched[touched < common]).to(x.device)
        fp = torch.empty(rows, dtype=torch.int64, device=x.device)
        fp[:common] = cbase.fingerprints[:common].to(x.device)
        # index_select, not x[t]: advanced indexing of a [rows, 64] float32 table took
        # ~7x as long for the same rows (0.35 ms against 0.05 ms for 8000, one thread),
        # ~40% of planning a block's touched rows in the stall (issue 26).
        now = row_fingerprints(torch.index_select(x, 0, t)) if t.numel() else fp[:0]
        fp.index_copy_(0, t, now)
        if rows > common:
            fp[common:] = row_fingerprints(x[common:])
        # A touched row that holds what it held is not written: a tracker (TorchRec's
        # ModelDeltaTracker) reports lookups, and a looked-up row need not have changed.
        was = torch.index_select(cbase.fingerprints, 0, t.to(cbase.fingerprints.device))
        changed = t[now != was.to(x.device)].cpu().numpy()
    elif cbase is None and borrow:
        # Nothing to diff against: the new diff base's fingerprints are taken on another
        # thread while this one encodes and the writer writes; the waiting caller stores
        # them (TablePlan.fingerprint_later).
        fp = None
        fp_future = _fp_pool().submit(row_fingerprints, x)
        changed = np.zeros(0, dtype=np.int64)
    elif cbase is not None and cbase.fingerprints is not None:
        # One pass: each row's fingerprint is compared with the base's as it is made.
        fp, changed = fingerprints_and_changes(x, cbase.fingerprints[:common])
    else:
        fp = row_fingerprints(x)
        changed = (
            _changed_old_rows(name, x, fp, cbase, common, scheme, wide) if cbase is not None
            else np.zeros(0, dtype=np.int64)
        )

    nblocks = -(-rows // block_rows)
    counts = np.bincount(changed // block_rows, minlength=nblocks) if len(changed) else None
    new_fp = old_fp = None
    if len(changed) and fp is not None:
        sel = torch.from_numpy(changed)
        new_fp = fp[sel.to(fp.device)].cpu().numpy()
        if cbase is not None and cbase.fingerprints is not None:
            old_fp = cbase.fingerprints[sel.to(cbase.fingerprints.device)].cpu().numpy()
        elif cbase is not None and cbase.seed_codes is not None and scheme == "exact":
            # Seeded from stored codes: exact codes are the rows' bytes.
            prev = cbase.seed_codes[sel].view(table.dtype).reshape(len(sel), width)
            old_fp = row_fingerprints(prev).numpy()
    slots: list[BlockSlot | None] = []
    writes: list[BlockWrite] = []
    parts: list = []   # rows to encode, ascending: (start, stop) of a full block, or ids
    pos = 0
    cuts = np.searchsorted(changed, np.arange(nblocks + 1, dtype=np.int64) * block_rows
                           ).tolist() if len(changed) else None
    rewritten = 0
    for i in range(nblocks):
        start = i * block_rows
        nr = min(start + block_rows, rows) - start
        old = cbase.slots[i] if cbase is not None and i < len(cbase.slots) else None
        if layout == "grouped":
            k = int(counts[i]) if counts is not None else 0
            if old is not None and old.nrows == nr and k == 0:
                slots.append(old)
                continue
            gw = None
            if old is not None and old.nrows == nr:
                group, lost = _group_of(old, cbase, rnb)
                rewritten += lost
                if group is not None:
                    assert cuts is not None
                    gw = next_group(group, changed[cuts[i]:cuts[i + 1]] - start, step, rnb)
            if gw is None:
                gw = fresh_group(nr, rnb, step)
            slot = BlockSlot(nr, len(gw.group.pieces),
                             sum(p.nbytes for p in gw.group.pieces))
            slot.group = gw.group
            slots.append(slot)
            if gw.rows is None:
                parts.append((start, start + nr))
                writes.append(BlockWrite(i, GROUPED, pos, pos + nr, None, group=gw))
            else:
                parts.append(gw.rows + start)
                writes.append(BlockWrite(i, GROUPED, pos, pos + len(gw.rows), gw.rows,
                                         group=gw))
            pos += writes[-1].stop - writes[-1].start
            continue
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
    # A table written whole (first put, new encoding) is encoded without an index array:
    # an arange over 10^9 rows would cost 8 GB.
    idx = None if pos == rows else np.concatenate(
        [np.arange(*p, dtype=np.int64) if isinstance(p, tuple) else p for p in parts]
        or [np.zeros(0, dtype=np.int64)]
    )

    borrowed = None
    later = None
    if defer_encode and idx is not None and not keep_full:
        later = snapshot_rows(name, x, idx, scheme, buffers, wide)
    if later is not None:
        # The changed rows are copied now (the step's values); the writer encodes them.
        codes, release = np.zeros((0, rnb), dtype=np.uint8), later[1]
    elif borrow and idx is None and scheme == "exact" and x.device.type == "cpu" and (
            x.is_contiguous() and x.numel()):
        # A blocking put of a whole exact table: its codes are the table's own bytes, read
        # by the writer while the caller waits (no staging copy of the table).
        codes, release = x.view(torch.uint8).numpy().reshape(rows, rnb), None
        borrowed = threading.Event()
    else:
        codes, release = gather_encode(name, x, idx, scheme, rnb, buffers, wide)
    state = TableState(
        shape=tuple(table.shape),
        dtype=table.dtype,
        scheme=scheme,
        block_rows=block_rows,
        fanout=fanout,
        row_nbytes=rnb,
        slots=slots,
        fingerprints=fp,
        segments=list(cbase.segments) if cbase is not None else [],
        reader=cbase.reader if cbase is not None else None,
    )
    logical = table.numel() * table.element_size()
    base_slots = cbase.slots if cbase is not None else None
    nchanged = len(changed) + rows - common if compatible else rows
    plan = TablePlan(name, state, writes, codes, nchanged, logical, base_slots, release)
    plan.step, plan.layout, plan.rewritten_blocks = step, layout, rewritten
    plan.borrowed = borrowed
    if later is not None:
        plan.encode_later = later[0]
    if fp is None:
        def fingerprint_later() -> None:
            state.fingerprints = fp_future.result()
        plan.fingerprint_later = fingerprint_later
    if keep_full and compatible and rows:
        if idx is None:
            plan.full_codes = codes
        else:
            plan.full_codes, _ = gather_encode(name, x, None, scheme, rnb, None, wide)
    if cbase is not None and cbase.damaged_blocks:
        plan.damaged_blocks = frozenset(i for i in cbase.damaged_blocks if i < nblocks)
    return plan

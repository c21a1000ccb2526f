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
from cnrstore.core.chainpolicy import block_key, next_slot, patch_fits
from cnrstore.core.hostcodes import HostBuffers, encode_checked, gather_encode, snapshot_rows
from cnrstore.core.tablestate import BlockSlot, TableState
from cnrstore.errors import NonFiniteValues

__all__ = ["BlockWrite", "TablePlan", "HostBuffers", "plan_table", "FULL", "PATCH"]

FULL = 0
PATCH = 1


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
    # (``_Deferred``): ``encoded()`` fills ``writes``, ``codes``, ``rows_changed`` and the
    # state's slots and fingerprints on the writer thread, before any block is written.
    plan_later: Callable[[], None] | None = None

    def encoded(self) -> None:
        """Run a deferred plan and encode (once; a no-op for plans made when planned)."""
        if self.plan_later is not None:
            later, self.plan_later = self.plan_later, None
            later()
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
    if base is not None:
        base.settle()  # a deferred plan of the last put: the writer fills it in first
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
    defer_plan: bool = False,
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

    if (defer_plan and cbase is not None and touched is not None and scheme == "exact"
            and cbase.fingerprints is not None and cbase.fingerprints.device.type == "cpu"
            and rows == cbase.rows and x.device.type == "cpu" and width and buffers is not None
            and not keep_full and not borrow):
        return _Deferred(name, x, table, cbase, touched, rnb, block_rows, fanout, max_chain,
                         block_offset, buffers).plan
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

    slots, writes, parts, pos = _blocks(name, fp, changed, cbase, rows, table.dtype, width,
                                        scheme, rnb, block_rows, max_chain, block_offset)
    nblocks = len(slots)
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
    )
    logical = table.numel() * table.element_size()
    base_slots = cbase.slots if cbase is not None else None
    nchanged = len(changed) + rows - common if compatible else rows
    plan = TablePlan(name, state, writes, codes, nchanged, logical, base_slots, release)
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


def _blocks(name: str, fp: torch.Tensor | None, changed: np.ndarray, cbase: TableState | None,
            rows: int, dtype: torch.dtype, width: int, scheme: str, rnb: int, block_rows: int,
            max_chain: int, block_offset: int
            ) -> tuple[list[BlockSlot | None], list[BlockWrite], list, int]:
    """(the new slots, the writes, the rows each write takes, ascending: (start, stop) of
    a full block or table row ids, and how many rows they are) of a table whose rows
    ``changed`` (ascending) differ from its diff base ``cbase`` (None: every block full);
    ``fp``: the new fingerprints (None: not known yet, a first put)."""
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
            prev = cbase.seed_codes[sel].view(dtype).reshape(len(sel), width)
            old_fp = row_fingerprints(prev).numpy()
    slots: list[BlockSlot | None] = []
    writes: list[BlockWrite] = []
    parts: list = []   # rows to encode, ascending: (start, stop) of a full block, or ids
    pos = 0
    cuts = np.searchsorted(changed, np.arange(nblocks + 1, dtype=np.int64) * block_rows
                           ).tolist() if len(changed) else None
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


class _Deferred:
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
        slots, writes, parts, pos = _blocks(
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

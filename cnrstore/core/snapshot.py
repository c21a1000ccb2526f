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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from cnrstore.codec.cores import thread_pool
from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.codec.fpdiff import fingerprints_and_changes, touched_changes
from cnrstore.codec.quantize import (
    NeedsWideQparams,
    decode_rows,
    first_nonfinite_row,
    is_wide,
    row_nbytes,
)
from cnrstore.core.blockplan import FULL, PATCH, BlockWrite, TablePlan, block_writes
from cnrstore.core.grouppolicy import grouped_writes
from cnrstore.core.hostcodes import HostBuffers, encode_checked, gather_encode, snapshot_rows
from cnrstore.core.tablestate import TableState, Undo
from cnrstore.core.writerplan import Policy, WriterPlan
from cnrstore.errors import NonFiniteValues

__all__ = ["BlockWrite", "TablePlan", "HostBuffers", "plan_table", "FULL", "PATCH"]

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
        if base.untracked:  # the caller tracked rows since a put that failed: not enough
            kwargs["touched"] = None
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
    layout: str = "chains",
    step: int = 0,
    store_objects: Any = None,
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

    # A tracked non-blocking put plans on the writer thread (writerplan.py): a single
    # process's of either layout, exact or intN; a rank's (its writer does not read the
    # store, which a grouped cleaner needs) of exact chains.
    local = defer_encode and store_objects is not None
    rank = defer_plan and layout == "chains" and scheme == "exact"
    if ((local or rank) and cbase is not None and touched is not None
            and cbase.fingerprints is not None and cbase.fingerprints.device.type == "cpu"
            and rows == cbase.rows and x.device.type == "cpu" and width and buffers is not None
            and not keep_full and not borrow):
        planned = WriterPlan.make(name, x, table, cbase,
                                  Policy(layout, max_chain, block_offset), touched, scheme,
                                  rnb, wide, step, buffers, store_objects)
        if planned is not None:
            return planned.plan
    if cbase is not None and touched is not None and cbase.fingerprints is not None:
        # The caller tracked the touched rows: hash only those (and any new rows).
        t = torch.unique(touched[touched < common]).to(x.device)
        fp = torch.empty(rows, dtype=torch.int64, device=x.device)
        fp[:common] = cbase.fingerprints[:common].to(x.device)
        if rows > common:
            fp[common:] = row_fingerprints(x[common:])
        # A touched row that holds what it held is not written: a tracker (TorchRec's
        # ModelDeltaTracker) reports lookups, and a looked-up row need not have changed.
        changed = touched_changes(x, t, fp)
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

    rewritten = 0
    if layout == "grouped":
        slots, writes, parts, pos, rewritten = grouped_writes(changed, cbase, rows, rnb,
                                                              block_rows, step)
    else:
        slots, writes, parts, pos = block_writes(name, fp, changed, cbase, rows, table.dtype,
                                                 width, scheme, rnb, block_rows, max_chain,
                                                 block_offset)
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
        reader=cbase.reader if cbase is not None else None,
    )
    if cbase is not None and cbase.fingerprints is not None and rows >= cbase.rows:
        state.undo = Undo(cbase, changed)  # back to the base, should this put fail
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

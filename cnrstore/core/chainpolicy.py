"""When a changed block is written as a patch, a merged patch, or a full block (issue 27,
"What a long run costs"; docs/MANIFEST.md, "Write rules").

A block's patches accumulate until its chain reaches a budget; then a fixed policy
(every chain at the same bound) rewrites every block of a table at the same step, and
one put writes the whole table. Here each block has its own budget, spread by the golden
ratio over [0.5, 1] of the block's bytes (and its own depth cap over [max_chain/2,
max_chain]), so blocks reach their bound at different steps. A block at its bound is
written as ONE merged patch on its full block, holding the rows that differ from that
full block (their current codes), when that patch is at most half the budget: hot rows
change again and again, so the union of changed rows grows far slower than the chain.
Otherwise the block is written full. The budget depends only on the block's index in
the table, the table's name and the block's size, so ids stay the same at any world
size.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import torch

from cnrstore.codec import native
from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.core.tablestate import BlockSlot
from cnrstore.format.blocks import KIND_BLOCK_PATCH, decode_full, decode_patch, patch_nbytes

__all__ = ["block_key", "stagger", "chain_budget", "depth_cap", "next_slot", "rebuild",
           "patch_fits", "MERGE_SHARE", "BUDGET_RANGE"]

_PHI = (5 ** 0.5 - 1) / 2
# A merged patch is written when it is at most this share of the block's chain budget.
MERGE_SHARE = 0.5
# The chain budgets of a table's blocks spread over this range of a block's bytes. Not a
# store option: benches/bench_longrun.py sets both to draw the write / restore-read
# trade-off (docs/design/diff-base.md, "Long runs"); a store keeps the defaults.
BUDGET_RANGE = (0.5, 1.0)


def block_key(table: str, block: int) -> int:
    """The index the bounds of ``block`` of ``table`` are spread by: tables start at
    different points of the sequence, so the blocks of tables put together do not
    reach their bounds together."""
    return (zlib.crc32(table.encode("utf-8", "surrogatepass")) & 0xFFFF) + block


def stagger(index: int) -> float:
    """Block ``index``'s share of its bounds, in [0.5, 1): successive blocks spread evenly."""
    return 0.5 + 0.5 * ((index * _PHI) % 1.0)


def chain_budget(index: int, nrows: int, row_nbytes: int) -> int:
    """Patch bytes block ``index`` may hold above its full block."""
    lo, hi = BUDGET_RANGE
    return int((lo + (hi - lo) * ((index * _PHI) % 1.0)) * nrows * row_nbytes)


def depth_cap(index: int, max_chain: int) -> int:
    """Patches block ``index`` may hold above its full block (0: never patched)."""
    if max_chain <= 0:
        return 0
    return max(1, round(max_chain * stagger(index)))


def _grow(union: np.ndarray, fsig: np.ndarray, rows: np.ndarray, old_fp: np.ndarray,
          new_fp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows that differ from the full block after ``rows`` (ascending, block-local)
    changed from ``old_fp`` to ``new_fp``: a row back at its full-block value leaves.
    One merge pass in the compiled kernel (cnr_grow_union) where it is loaded: this numpy
    form takes a dozen calls and four copies of the union per block, 20-30 ms of a
    non-blocking put's stall over 58 blocks (issue 27); both give the same arrays."""
    kernels = native.kernel()
    if kernels is not None and kernels.grow_union is not None:
        args = [np.ascontiguousarray(a, dtype=np.int64)
                for a in (union, fsig, rows, old_fp, new_fp)]
        out_u = np.empty(len(union) + len(rows), dtype=np.int64)
        out_f = np.empty_like(out_u)
        k = kernels.grow_union(args[0].ctypes.data, args[1].ctypes.data, len(union),
                               args[2].ctypes.data, args[3].ctypes.data,
                               args[4].ctypes.data, len(rows), out_u.ctypes.data,
                               out_f.ctypes.data)
        return out_u[:k], out_f[:k]
    if len(union):
        pos = np.searchsorted(union, rows)
        at = np.minimum(pos, len(union) - 1)
        known = (pos < len(union)) & (union[at] == rows)
        back = known & (new_fp == fsig[at])
        if back.any():
            keep = np.ones(len(union), dtype=bool)
            keep[at[back]] = False
            union, fsig = union[keep], fsig[keep]
    else:
        known = np.zeros(len(rows), dtype=bool)
    fresh = ~known
    ins = np.searchsorted(union, rows[fresh])
    return np.insert(union, ins, rows[fresh]), np.insert(fsig, ins, old_fp[fresh])


def patch_fits(old: BlockSlot, key: int, nchanged: int, row_nbytes: int, max_chain: int
               ) -> bool:
    """Whether ``nchanged`` changed rows of the block in ``old`` go on its chain as a patch
    (``next_slot``'s first choice). It grows with ``nchanged``: so a block whose tracked
    rows fit fits with any subset of them changed, and needs none of its other rows
    (snapshot.py, a deferred plan's copy)."""
    return (old.depth < depth_cap(key, max_chain)
            and old.chain_bytes + patch_nbytes(old.nrows, nchanged, row_nbytes)
            <= chain_budget(key, old.nrows, row_nbytes))


def next_slot(old: BlockSlot, key: int, rows: np.ndarray, old_fp: np.ndarray | None,
              new_fp: np.ndarray, row_nbytes: int, max_chain: int
              ) -> tuple[BlockSlot, np.ndarray | None, BlockSlot | None]:
    """The new slot of a changed block (``key``: its ``block_key``; rows ``rows`` changed,
    block-local), the
    rows to write (None: the whole block) and the slot of the patch's base (None: full).
    ``old_fp``: the changed rows' previous fingerprints (None: unknown, a base seeded
    from stored codes; the block is then not merged before its next full rewrite)."""
    nr = old.nrows
    full = old if old.depth == 0 else old.full
    union = fsig = None
    if old.union is not None and old.fsig is not None and full is not None and old_fp is not None:
        union, fsig = _grow(old.union, old.fsig, rows, old_fp, new_fp)
    else:
        full = None
    if patch_fits(old, key, len(rows), row_nbytes, max_chain):
        pbytes = patch_nbytes(nr, len(rows), row_nbytes)
        slot = BlockSlot(nr, old.depth + 1, old.chain_bytes + pbytes, full=full, union=union,
                         fsig=fsig)
        return slot, rows, old
    if union is not None and full is not None and depth_cap(key, max_chain) >= 1:
        mbytes = patch_nbytes(nr, len(union), row_nbytes)
        if mbytes <= MERGE_SHARE * chain_budget(key, nr, row_nbytes):
            return BlockSlot(nr, 1, mbytes, full=full, union=union, fsig=fsig), union, full
    return BlockSlot(nr), None, None


def rebuild(get: Callable, slot: BlockSlot, current: np.ndarray, dtype: torch.dtype) -> None:
    """Give ``slot`` (an exact block stored as a patch chain, seeded from the store) the
    merge state a handle that wrote the chain would hold: its full block, and the rows
    whose codes differ from it (candidates: the chain's patch indices) with their
    fingerprints in it. ``current``: the block's codes as stored. May raise StoreError or
    ManifestError (the slot is then left as it was: never merged)."""
    assert slot.oid is not None
    cand: list[np.ndarray] = []
    cur = slot.oid
    for _ in range(slot.depth + 1):
        obj = get(cur)
        if obj.kind != KIND_BLOCK_PATCH:
            break
        cand.append(decode_patch(obj, cur)[1])
        cur = obj.refs[0]
    else:
        return  # deeper than the manifest says: not a chain to merge
    full = decode_full(obj, cur)
    if full.shape != current.shape or not full.shape[1]:
        return
    rows = np.unique(np.concatenate(cand)) if cand else np.zeros(0, dtype=np.int64)
    rows = rows[np.any(full[rows] != current[rows], axis=1)]
    fsig = np.zeros(0, dtype=np.int64)
    if len(rows):
        old = torch.from_numpy(np.ascontiguousarray(full[rows])).view(dtype)
        fsig = row_fingerprints(old.reshape(len(rows), -1)).numpy()
    slot.full = BlockSlot(slot.nrows, oid=cur)
    slot.union, slot.fsig = rows.astype(np.int64), fsig

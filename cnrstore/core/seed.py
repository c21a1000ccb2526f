"""Seeding a table's diff base from the store, for its first put in a handle (DESIGN.md:
"the newest stored step holding it"; docs/MANIFEST.md, "Write rules").

A damaged store must never stop a checkpoint (issue 8): steps whose nodes cannot be read
are passed over, and blocks of the base that cannot be read are left out of it (their
slots are None, so the put writes them in full) and listed in ``damaged_blocks``, so
the writer avoids re-using a damaged record of the same content (writer.py).
"""

from __future__ import annotations

from concurrent.futures import Executor

import numpy as np
import torch

from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.core.blockread import block_codes
from cnrstore.core.chainpolicy import rebuild
from cnrstore.core.restore import run_all
from cnrstore.core.tablestate import DeferredBase, TableState, parse_dtype
from cnrstore.errors import CheckpointError
from cnrstore.format.load import list_steps, load_step, load_table_manifest
from cnrstore.format.manifest import TableManifest, root_name
from engine import ObjectStore, StoreClosed, StoreError

__all__ = ["read_codes", "seed_later", "seed_state"]


def seed_state(
    objects: ObjectStore,
    name: str,
    table: torch.Tensor,
    scheme: str,
    *,
    block_rows: int,
    fanout: int,
    pool: Executor,
) -> TableState | None:
    """Diff base of ``name`` from the newest stored step holding a readable node of it, or
    None when no step holds it or that step's version has another geometry or encoding."""
    for step in reversed(list_steps(objects)):
        try:
            oid, node = load_step(objects, step)
            if name not in node.tables:
                continue
            tm = load_table_manifest(objects, node.table_ids[node.tables.index(name)])
        except (StoreError, CheckpointError):
            continue  # damaged (or dropped meanwhile): an older step may hold the table
        break
    else:
        return None
    state = TableState.from_manifest(tm, anchor=(root_name(step), oid))
    shape = tuple(table.shape)
    if not state.compatible(shape, table.dtype, scheme, block_rows, fanout) or (
        (len(shape) == 1) != (len(tm.node.shape) == 1)
    ):
        return None
    damaged: set[int] = set()
    try:
        codes = read_codes(objects, tm, pool, damaged=damaged)
    except MemoryError:  # a base too large to hold: the put writes the table in full
        return None
    for i in damaged:
        state.slots[i] = None
    state.damaged_blocks = frozenset(damaged)
    state.seed_codes = torch.from_numpy(codes)
    if scheme == "exact":
        # Which rows differ from each chain's full block, so the chains can be merged as
        # the handle that wrote them would (same ids); unknown: rewritten full instead.
        for i, slot in enumerate(state.slots):
            if slot is not None and slot.depth:
                start, stop = tm.node.block_range(i)
                try:
                    rebuild(objects.get, slot, codes[start:stop], table.dtype)
                except (StoreError, CheckpointError):
                    pass
    return state


def read_codes(
    objects: ObjectStore, tm: TableManifest, pool: Executor, *, damaged: set | None = None
) -> np.ndarray:
    """All encoded rows ``uint8[rows, row_nbytes]`` of a stored table (seeding a diff base).
    With ``damaged`` (a set), blocks that cannot be read or decoded are added to it by
    index, their rows left zero, instead of failing the whole read."""
    node = tm.node
    out = np.empty((node.rows, node.row_nbytes), dtype=np.uint8)

    def one(i: int) -> None:
        start, stop = node.block_range(i)
        try:
            out[start:stop] = block_codes(objects, tm, i)
        except (StoreError, CheckpointError):
            if damaged is None:
                raise
            out[start:stop] = 0
            damaged.add(i)

    run_all(pool, one, range(node.nblocks))
    return out


def seed_later(objects: ObjectStore, tm: TableManifest) -> DeferredBase:
    """The diff data of a restored table, computed from the stored step on a background
    thread (TableState.materialize waits for it at the table's next put): fingerprints of
    an exact table, block by block with no table-sized buffer, or the stored codes of a
    lossy one. A restore returns without this work, which cost as much as a third of an
    exact restore (docs/PERFORMANCE.md); an exact step's stored rows are bit-identical to
    what the restore returned, so the fingerprints are the same as if taken then. Blocks
    that cannot be read are reported (the put writes them full)."""
    node = tm.node
    lossy = node.scheme != "exact"
    dtype = parse_dtype(node.dtype)

    def compute(cancel) -> tuple[torch.Tensor | None, np.ndarray | None, set[int]]:
        codes = np.empty((node.rows, node.row_nbytes), dtype=np.uint8) if lossy else None
        fps = None if lossy else torch.empty(node.rows, dtype=torch.int64)
        damaged: set[int] = set()
        for i in range(node.nblocks):
            if cancel.is_set():
                raise StoreClosed("the store was closed while a diff base was seeded")
            start, stop = node.block_range(i)
            try:
                block = block_codes(objects, tm, i)
            except StoreClosed:
                raise
            except (StoreError, CheckpointError):
                damaged.add(i)
                continue
            if codes is not None:
                codes[start:stop] = block
            elif fps is not None and stop > start:
                rows = (torch.from_numpy(block).view(dtype) if node.width
                        else torch.empty((stop - start, 0), dtype=dtype))
                row_fingerprints(rows.reshape(stop - start, node.width), out=fps[start:stop])
        return fps, codes, damaged

    return DeferredBase(compute, objects)

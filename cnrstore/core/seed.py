"""Seeding a table's diff base from the store, for its first put in a handle (DESIGN.md:
"the newest stored step holding it"; docs/MANIFEST.md, "Write rules").

A damaged store must never stop a checkpoint (issue 8): steps whose nodes cannot be read
are passed over, and blocks of the base that cannot be read are left out of it (their
slots are None, so the put writes them in full) and listed in ``damaged_blocks``, so
the writer avoids re-using a damaged record of the same content (writer.py).
"""

from __future__ import annotations

from concurrent.futures import Executor

import torch

from cnrstore.core.chainpolicy import rebuild
from cnrstore.core.restore import read_codes
from cnrstore.core.tablestate import TableState
from cnrstore.errors import CheckpointError
from cnrstore.format.load import list_steps, load_step, load_table_manifest
from cnrstore.format.manifest import root_name
from engine import ObjectStore, StoreError

__all__ = ["seed_state"]


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

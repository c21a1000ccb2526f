"""Diff bases of a distributed put's first put of a table in a handle, seeded from the
store (DESIGN.md: "The first put of a table in a fresh handle ... storage must not
double"; the single-process rule is core/seed.py).

A rank that owns blocks ``[b0, b1)`` of a table and holds no diff base for them asks the
coordinator, which finds the newest stored step holding the table (passing over damaged
ones) and sends the table's manifest and the locations of those blocks. The rank then
reads their codes and builds the base of exactly its blocks; its put compares codes row
by row as a single-process seeded put does, so it writes the same objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cnrstore.core.chainpolicy import rebuild
from cnrstore.core.tablestate import BlockSlot, TableState
from cnrstore.distributed import transfer
from cnrstore.errors import CheckpointError
from cnrstore.format.blocks import resolve
from cnrstore.format.load import list_steps, load_step, load_table_manifest
from cnrstore.format.manifest import root_name
from engine import StoreError

__all__ = ["answer", "build"]

Need = tuple[str, int, int]   # (table, first block, end block) a rank owns without a base


def answer(objects: Any, needs: list[list[Need]]) -> list[list[Any]]:
    """On the coordinator: per rank, per need, (manifest, anchor, locations) or None."""
    found: dict[str, Any] = {}
    for name in sorted({n for ns in needs for n, _, _ in ns}):
        found[name] = None
        for step in reversed(list_steps(objects)):
            try:
                oid, node = load_step(objects, step)
                if name not in node.tables:
                    continue
                tm = load_table_manifest(objects, node.table_ids[node.tables.index(name)])
            except (StoreError, CheckpointError):
                continue  # damaged (or dropped meanwhile): an older step may hold it
            found[name] = (tm, (root_name(step), oid))
            break
    out = []
    for rank, ns in enumerate(needs):
        mine: list[Any] = []
        for name, b0, b1 in ns:
            hit = found[name]
            if hit is None:
                mine.append(None)
                continue
            tm, anchor = hit
            ids = tm.block_ids[b0:b1]
            try:
                where = None if rank == 0 or not ids else transfer.locate(objects, ids)
            except (StoreError, CheckpointError):
                mine.append(None)
                continue
            mine.append((tm, anchor, where))
        out.append(mine)
    return out


def build(objects: Any, got: Any, *, b0: int, b1: int, shape: tuple[int, ...],
          dtype: torch.dtype, scheme: str, block_rows: int, fanout: int) -> TableState | None:
    """The diff base of blocks ``[b0, b1)`` from an ``answer`` entry, None when the stored
    table has another geometry or encoding (the put then writes those blocks full)."""
    if got is None:
        return None
    tm, anchor, _ = got
    node = tm.node
    if (node.shape[1:] != tuple(shape[1:]) or node.dtype != str(dtype).removeprefix("torch.")
            or node.scheme != scheme or node.block_rows != block_rows
            or node.fanout != fanout or (len(node.shape) == 1) != (len(shape) == 1)):
        return None
    end = min(b1, node.nblocks)
    if end <= b0:
        return None
    lo, hi = b0 * block_rows, min(end * block_rows, node.rows)
    codes = np.zeros((hi - lo, node.row_nbytes), dtype=np.uint8)
    slots: list[BlockSlot | None] = []
    ids, depth, chain = tm.block_ids, tm.depth, tm.chain_bytes
    for i in range(b0, end):
        start, stop = node.block_range(i)
        try:
            block = resolve(objects.get, ids[i], info=objects.info,
                            shape=(stop - start, node.row_nbytes))
            if block.shape != (stop - start, node.row_nbytes):
                raise CheckpointError("block of the wrong shape")
            codes[start - lo:stop - lo] = block
            slot = BlockSlot(stop - start, depth[i], chain[i], ids[i])
            if scheme == "exact" and slot.depth:
                rebuild(objects.get, slot, block, dtype)  # as core/seed.py
            slots.append(slot)
        except (StoreError, CheckpointError):
            slots.append(None)  # unreadable: written full by the put
    return TableState(shape=(hi - lo, *node.shape[1:]), dtype=dtype, scheme=scheme,
                      block_rows=block_rows, fanout=fanout, row_nbytes=node.row_nbytes,
                      slots=slots, seed_codes=torch.from_numpy(codes), anchor=anchor)

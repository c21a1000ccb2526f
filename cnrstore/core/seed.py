"""Seeding a table's diff base from the store, for its first put in a handle
(docs/ARCHITECTURE.md, "A put and a get", Seeding: "the newest stored step holding it";
docs/MANIFEST.md, "Write rules").

A damaged store must never stop a checkpoint (issue 8): steps whose nodes cannot be read
are passed over, and blocks of the base that cannot be read are left out of it (their
slots are None, so the put writes them in full) and listed in ``damaged_blocks``, so
the writer avoids re-using a damaged record of the same content (writer.py).
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch

from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.core.blockread import block_codes
from cnrstore.core.chainpolicy import rebuild
from cnrstore.core.restore import run_all
from cnrstore.core.tablestate import DeferredBase, TableState, parse_dtype
from cnrstore.errors import CheckpointError
from cnrstore.format.blocks import KIND_BLOCK_PATCH
from cnrstore.format.load import list_steps, load_step, load_table_manifest
from cnrstore.format.manifest import TableManifest, root_name
from engine import ObjectStore, StoreClosed, StoreError

__all__ = ["newest_version", "read_codes", "seed_blocks", "seed_later", "seed_state"]

Anchor = tuple[str, bytes]  # (root name, step node id) of the step a base was read from


def newest_version(objects: ObjectStore, name: str) -> tuple[TableManifest, Anchor] | None:
    """The manifest of ``name`` in the newest stored step holding a readable node of it,
    with that step's anchor; None when no step holds it."""
    for step in reversed(list_steps(objects)):
        try:
            oid, node = load_step(objects, step)
            if name not in node.tables:
                continue
            tm = load_table_manifest(objects, node.table_ids[node.tables.index(name)])
        except (StoreError, CheckpointError):
            continue  # damaged (or dropped meanwhile): an older step may hold the table
        return tm, (root_name(step), oid)
    return None


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
    found = newest_version(objects, name)
    if found is None:
        return None
    return seed_blocks(objects, found[0], found[1], shape=tuple(table.shape),
                       dtype=table.dtype, scheme=scheme, block_rows=block_rows,
                       fanout=fanout, pool=pool)


def seed_blocks(objects: Any, tm: TableManifest, anchor: Anchor, *, shape: tuple[int, ...],
                dtype: torch.dtype, scheme: str, block_rows: int, fanout: int,
                pool: Executor, blocks: tuple[int, int] | None = None) -> TableState | None:
    """The diff base, read from stored table ``tm``, of a table of ``shape`` and
    ``dtype`` put with ``scheme``: of all its blocks, or (a distributed put's block owner)
    of blocks ``[b0, b1)`` only, as a state of just those rows. None when the stored
    version has another geometry or encoding (the put then writes those blocks full).
    ``objects`` may be any object source with ``get`` and ``info`` (a rank's located
    records). Unreadable blocks get no slot and are listed in ``damaged_blocks``, their
    unreadable records in ``damaged_ids``: the writer never dedups onto those."""
    state = TableState.from_manifest(tm, anchor=anchor)
    node = tm.node
    if not state.compatible(shape, dtype, scheme, block_rows, fanout) or (
        (len(shape) == 1) != (len(node.shape) == 1)
    ):
        return None
    first, end = (0, node.nblocks) if blocks is None else (blocks[0],
                                                            min(blocks[1], node.nblocks))
    if blocks is not None:
        if end <= first:
            return None
        lo, hi = first * block_rows, min(end * block_rows, node.rows)
        state = TableState(shape=(hi - lo, *node.shape[1:]), dtype=state.dtype,
                           scheme=scheme, block_rows=block_rows, fanout=fanout,
                           row_nbytes=node.row_nbytes, slots=state.slots[first:end],
                           anchor=anchor)
    state.reader = objects.get  # the grouped layout's lists, loaded when a block changes
    damaged: set[int] = set()
    try:
        codes = read_codes(objects, tm, pool, damaged=damaged, blocks=(first, end))
    except MemoryError:  # a base too large to hold: the put writes the table in full
        return None
    bad: set[bytes] = set()
    for i in damaged:
        state.slots[i - first] = None
        bad |= _unreadable(objects, tm.block_ids[i], tm.depth[i])
    state.damaged_blocks = frozenset(i - first for i in damaged)
    state.damaged_ids = frozenset(bad)
    state.seed_codes = torch.from_numpy(codes)
    if scheme == "exact":
        # Which rows differ from each chain's full block, so the chains can be merged as
        # the handle that wrote them would (same ids); unknown: rewritten full instead.
        lo = first * block_rows
        for i, slot in enumerate(state.slots):
            if slot is not None and slot.depth:
                start, stop = node.block_range(first + i)
                try:
                    rebuild(objects.get, slot, codes[start - lo:stop - lo], dtype)
                except (StoreError, CheckpointError):
                    pass
    return state


def _unreadable(objects: Any, oid: bytes, depth: int) -> set[bytes]:
    """The records of block ``oid``'s chain that cannot be read (a distributed put's
    writer cannot read the store: it is told these instead, writer.py ``_write_full``)."""
    for _ in range(depth + 1):
        try:
            obj = objects.get(oid)
        except (StoreError, CheckpointError):
            return {oid}
        if obj.kind != KIND_BLOCK_PATCH or not obj.refs:
            break
        oid = obj.refs[0]
    return set()


def read_codes(
    objects: Any, tm: TableManifest, pool: Executor, *, damaged: set | None = None,
    blocks: tuple[int, int] | None = None,
) -> np.ndarray:
    """The encoded rows ``uint8[rows, row_nbytes]`` of a stored table (seeding a diff
    base), of blocks ``[b0, b1)`` only when given. With ``damaged`` (a set), blocks that
    cannot be read or decoded are added to it by index, their rows left zero, instead of
    failing the whole read."""
    node = tm.node
    first, end = blocks or (0, node.nblocks)
    lo = first * node.block_rows
    hi = node.block_range(end - 1)[1] if end > first else lo
    out = np.empty((hi - lo, node.row_nbytes), dtype=np.uint8)

    def one(i: int) -> None:
        start, stop = node.block_range(i)
        try:
            out[start - lo:stop - lo] = block_codes(objects, tm, i)
        except (StoreError, CheckpointError):
            if damaged is None:
                raise
            out[start - lo:stop - lo] = 0
            damaged.add(i)

    run_all(pool, one, range(first, end))
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

"""Diff two steps from their Merkle DAGs: tables, then segments, then blocks, then rows.

Ids are compared top-down and an equal id ends the descent, so unchanged tables and
segments are never read past their id. Rows are found only for blocks whose ids differ:
when one block's patch chain leads to the other (the usual case between steps of one run)
the answer is the patches' row indices, read without decoding any full block; otherwise
both blocks are decoded and their codes compared row by row (cnrstore/core/blockdiff.py,
which ``store.changes`` uses too). Row ids are global rows of the table in step B. Rows
found from patch indices are the rows *written* between the two steps; a row written back
with identical codes still counts unless the older block's own patches show it (decoding
would not count it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cnrstore.core.blockdiff import diff_block
from cnrstore.errors import InvalidInput
from cnrstore.format.blocks import plan_chain
from cnrstore.format.load import load_segment, load_step, load_table
from cnrstore.format.manifest import TableNode
from engine import ObjectStore

__all__ = ["TableDiff", "StepDiff", "diff_steps", "diff_tables"]

@dataclass(frozen=True)
class TableDiff:
    name: str
    status: str                      # "added", "removed", "changed", "unchanged"
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    scheme_a: str | None
    scheme_b: str | None
    encoding_changed: bool           # dtype, width, scheme or block geometry differ
    segments_compared: int
    segments_equal: int              # skipped by id without reading their blocks
    blocks_changed: tuple[int, ...]  # blocks of B whose rows differ (rows=False: whose ids do)
    blocks_examined: int             # blocks whose ids differ (equal content may differ in id)
    rows_changed: int | None         # rows of the common range that differ (None: not computed)
    row_ranges: tuple[tuple[int, int], ...] | None  # half-open [start, stop) runs
    rows_added: int
    rows_removed: int
    blocks_decoded: int              # blocks decoded to find rows (both sides counted)
    patches_read: int                # patches whose indices answered instead


@dataclass(frozen=True)
class StepDiff:
    a: int
    b: int
    identical: bool                  # same root id: nothing at all differs
    metadata_changed: bool
    tables: tuple[TableDiff, ...]


def _ranges(rows: np.ndarray) -> tuple[tuple[int, int], ...]:
    if rows.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [rows.size]))
    return tuple((int(rows[s]), int(rows[e - 1]) + 1) for s, e in zip(starts, stops))


class _Rows:
    """Finds the differing rows of two versions of one block, reading as little as it can
    (cnrstore/core/blockdiff.py, shared with ``store.changes``)."""

    def __init__(self, objects: ObjectStore):
        self.objects = objects
        self.decoded = 0
        self.patches = 0

    def differing(self, a: bytes, b: bytes, common: int, depths: tuple[int, int],
                  shape_a: tuple[int, int], shape_b: tuple[int, int]) -> np.ndarray:
        """Sorted row offsets (< ``common``) of the block where versions ``a`` and ``b``
        (of the shapes their tables give them) differ."""
        # Both chains' sizes checked in the index before any payload is read.
        plan_chain(self.objects.info, a, *shape_a)
        plan_chain(self.objects.info, b, *shape_b)
        d = diff_block(self.objects.get, a, b, common, exact=True, b_newer=True,
                       depths=depths, codes=False)
        self.decoded += d.decoded
        self.patches += d.patches
        return d.rows[d.rows < common]


def _same_encoding(ta: TableNode, tb: TableNode) -> bool:
    return (ta.dtype, ta.shape[1:], ta.scheme, ta.row_nbytes, ta.block_rows, ta.fanout) == (
        tb.dtype, tb.shape[1:], tb.scheme, tb.row_nbytes, tb.block_rows, tb.fanout)


def diff_tables(objects: ObjectStore, name: str, a_id: bytes | None, b_id: bytes | None, *,
                rows: bool = True) -> TableDiff:
    """Diff one table given its table-node ids in A and B (None where it is absent)."""
    if a_id is None or b_id is None:
        if a_id is not None:  # only in A
            t = load_table(objects, a_id)
            return TableDiff(name, "removed", t.shape, None, t.scheme, None, False, 0, 0, (),
                             0, None, None, 0, t.rows, 0, 0)
        if b_id is None:
            raise InvalidInput(f"table {name!r} is in neither step")
        t = load_table(objects, b_id)
        return TableDiff(name, "added", None, t.shape, None, t.scheme, False, 0, 0,
                         tuple(range(t.nblocks)), 0, None, None, t.rows, 0, 0, 0)
    ta = load_table(objects, a_id)
    if a_id == b_id:
        n = len(ta.segment_ids)
        return TableDiff(name, "unchanged", ta.shape, ta.shape, ta.scheme, ta.scheme, False,
                         n, n, (), 0, 0 if rows else None, () if rows else None, 0, 0, 0, 0)
    tb = load_table(objects, b_id)
    added, removed = max(tb.rows - ta.rows, 0), max(ta.rows - tb.rows, 0)
    if not _same_encoding(ta, tb):
        # Every block was re-encoded: ids say nothing about rows, and codes of two schemes
        # do not compare. Report the table as rewritten without decoding it.
        return TableDiff(name, "changed", ta.shape, tb.shape, ta.scheme, tb.scheme, True,
                         0, 0, tuple(range(tb.nblocks)), tb.nblocks, None, None, added, removed,
                         0, 0)
    finder = _Rows(objects)
    changed: list[int] = []
    row_ids: list[np.ndarray] = []
    equal = examined = 0
    nseg = max(len(ta.segment_ids), len(tb.segment_ids))
    for j in range(nseg):
        sa = ta.segment_ids[j] if j < len(ta.segment_ids) else None
        sb = tb.segment_ids[j] if j < len(tb.segment_ids) else None
        if sa == sb:
            equal += 1
            continue
        if sb is None:
            continue  # only in A: rows removed, counted above
        seg_b = load_segment(objects, tb, j)
        seg_a = load_segment(objects, ta, j) if sa else None
        blocks_a = seg_a.block_ids if seg_a is not None else ()
        for k, bid in enumerate(seg_b.block_ids):
            i = j * tb.fanout + k
            aid = blocks_a[k] if k < len(blocks_a) else None
            if aid == bid:
                continue
            examined += 1
            start, stop_b = tb.block_range(i)
            common = max(min(stop_b, ta.rows) - start, 0)
            rows_a = max(min(start + ta.block_rows, ta.rows) - start, 0)
            if not rows or aid is None or common == 0:
                changed.append(i)
                continue
            # Equal content may be stored under another id (a patch vs a full block of
            # the same rows, written by another handle): only differing rows count.
            assert seg_a is not None
            found = finder.differing(aid, bid, common, (seg_a.depth[k], seg_b.depth[k]),
                                     (rows_a, ta.row_nbytes), (stop_b - start, tb.row_nbytes))
            if found.size or rows_a != stop_b - start:
                changed.append(i)
                row_ids.append(found + start)
    if rows:
        found = np.concatenate(row_ids) if row_ids else np.empty(0, np.int64)
        count, ranges = int(found.size), _ranges(found)
    else:
        count, ranges = None, None
    status = "changed" if changed or added or removed else "unchanged"
    return TableDiff(name, status, ta.shape, tb.shape, ta.scheme, tb.scheme, False, nseg,
                     equal, tuple(changed), examined, count, ranges, added, removed,
                     finder.decoded, finder.patches)


def diff_steps(objects: ObjectStore, a: int, b: int, *, rows: bool = True) -> StepDiff:
    """Diff steps ``a`` and ``b`` of an engine store (see the module docstring)."""
    a_root, na = load_step(objects, a)
    b_root, nb = load_step(objects, b)
    tables: list[TableDiff] = []
    if a_root != b_root:
        ids_a = dict(zip(na.tables, na.table_ids))
        ids_b = dict(zip(nb.tables, nb.table_ids))
        names = list(nb.tables) + [n for n in na.tables if n not in ids_b]
        for name in names:
            tables.append(diff_tables(objects, name, ids_a.get(name), ids_b.get(name),
                                      rows=rows))
    else:
        tables = [diff_tables(objects, n, t, t, rows=rows)
                  for n, t in zip(nb.tables, nb.table_ids)]
    return StepDiff(a, b, a_root == b_root, na.metadata != nb.metadata, tuple(tables))

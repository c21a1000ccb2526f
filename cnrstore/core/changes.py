"""Changes between two kept steps: the rows a replica of step a needs to become step b
(docs/GUIDE.md, "DCP, TorchRec, changes": ``store.changes``; docs/GUIDE.md, "Publishing changes").

One walk over both steps' DAGs, top-down: an equal table or segment id ends the descent
unread, and only blocks whose ids differ are looked at (cnrstore/core/blockdiff.py finds
their differing rows from the patches written between the steps). The changes of a table
come in batches of about one block's codes, so memory is bounded by a block, not a table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass

import numpy as np
import torch

from cnrstore.codec.quantize import decode_rows
from cnrstore.core.blockdiff import BlockDiff, diff_block, new_block
from cnrstore.core.restore import check_slice
from cnrstore.core.validate import check_selection, check_step
from cnrstore.errors import (
    InvalidInput,
    ManifestError,
    StepNotFound,
    TableNotFound,
    engine_errors,
)
from cnrstore.format.blocks import resolve
from cnrstore.format.load import load_step
from cnrstore.format.manifest import SegmentNode, StepNode, TableNode, parse_dtype, root_name
from engine import Object, StoreError

__all__ = ["Change", "KINDS", "changes", "check_request", "iter_changes"]

KINDS = ("rows", "added", "dropped", "reshaped")
_MIN_BATCH_ROWS = 64

Get = Callable[[bytes], Object]


@dataclass(frozen=True, eq=False)
class Change:
    """One piece of the changes from step ``a`` to step ``b`` of one table.

    ``kind`` is "rows" (``values`` are the rows ``rows`` of the table as
    ``get_tables(b)`` returns them), or a change of the table itself, with no rows:
    "added" (new in b), "dropped" (not in b), "reshaped" (b holds it with another shape
    or dtype). ``shape``, ``dtype`` and ``scheme`` are the table's in step b (None for
    "dropped"). After "added", or "reshaped" with another dtype or row shape, "rows"
    changes follow for every row; after a "reshaped" that only changed the row count,
    rows present in both steps keep their values unless a "rows" change names them.
    ``apply`` does all of that to a dict of tensors."""

    table: str
    rows: torch.Tensor           # int64 [n], ascending global row ids of step b
    values: torch.Tensor         # [n, *shape[1:]], the table's dtype in step b
    kind: str = "rows"
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    scheme: str | None = None

    def apply(self, tables: MutableMapping[str, torch.Tensor]) -> None:
        """Replay this change onto ``tables`` (name -> tensor, a replica of step a):
        rows are written in place, a reshaped or added table is replaced by a new tensor
        (on the old one's device) keeping the rows both shapes share."""
        if self.kind == "dropped":
            tables.pop(self.table, None)
            return
        if self.kind in ("added", "reshaped"):
            assert self.shape is not None and self.dtype is not None
            old = tables.get(self.table)
            device = old.device if old is not None else "cpu"
            new = torch.zeros(self.shape, dtype=self.dtype, device=device)
            if old is not None and old.dtype == self.dtype and old.shape[1:] == new.shape[1:]:
                n = min(old.shape[0], new.shape[0])
                new[:n] = old[:n]
            tables[self.table] = new
        if len(self.rows):
            dest = tables.get(self.table)
            if dest is None:
                raise InvalidInput(f"changes of table {self.table!r}: the replica does not "
                                   "hold it (is it a replica of step a?)")
            dest[self.rows.to(dest.device)] = self.values.to(dest.device)


def _empty(node: TableNode) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(0, dtype=torch.int64),
            torch.empty((0, *node.shape[1:]), dtype=parse_dtype(node.dtype)))


def _structural(kind: str, node: TableNode) -> Change:
    rows, values = _empty(node)
    return Change(node.name, rows, values, kind, node.shape, parse_dtype(node.dtype),
                  node.scheme)


class _Batch:
    """The changed rows of one table, decoded and handed out about a block at a time."""

    def __init__(self, node: TableNode):
        self.node = node
        self.limit = max(node.block_rows, _MIN_BATCH_ROWS)
        self.rows: list[np.ndarray] = []
        self.codes: list[np.ndarray] = []
        self.n = 0

    def add(self, rows: np.ndarray, codes: np.ndarray) -> Iterator[Change]:
        if len(rows):
            self.rows.append(rows)
            self.codes.append(codes)
            self.n += len(rows)
        if self.n >= self.limit:
            yield self.flush()

    def flush(self) -> Change:
        node = self.node
        dtype = parse_dtype(node.dtype)
        rows = np.concatenate(self.rows)
        codes = np.ascontiguousarray(np.concatenate(self.codes))
        self.rows, self.codes, self.n = [], [], 0
        if node.width:
            values = decode_rows(torch.from_numpy(codes), node.scheme, dtype, node.width)
        else:
            values = torch.empty((len(rows), 0), dtype=dtype)
        values = values.reshape((len(rows), *node.shape[1:]))
        return Change(node.name, torch.from_numpy(rows), values, "rows", node.shape, dtype,
                      node.scheme)

    def rest(self) -> Iterator[Change]:
        if self.n:
            yield self.flush()


class _Blocks:
    """Block ids of one table node, its segments read only when a block of them is
    asked for."""

    def __init__(self, get: Get, node: TableNode):
        self.get, self.node = get, node
        self.segments: dict[int, SegmentNode] = {}

    def segment(self, j: int) -> SegmentNode:
        seg = self.segments.get(j)
        if seg is None:
            sid = self.node.segment_ids[j]
            seg = self.segments[j] = SegmentNode.decode(self.get(sid), sid)
            if len(self.segments) > 2:  # walks go forward: keep the last two
                del self.segments[min(self.segments)]
        return seg

    def block(self, i: int) -> bytes:
        j, k = divmod(i, self.node.fanout)
        ids = self.segment(j).block_ids
        if k >= len(ids):
            raise ManifestError(f"table {self.node.name!r} lacks block {i}",
                                oid=self.node.segment_ids[j])
        return ids[k]

    def codes(self, i: int) -> np.ndarray:
        oid = self.block(i)
        codes = resolve(self.get, oid)
        start, stop = self.node.block_range(i)
        if codes.shape != (stop - start, self.node.row_nbytes):
            raise ManifestError(f"table {self.node.name!r} block {i} holds {codes.shape} "
                                f"codes", oid=oid)
        return codes


def _block_span(node: TableNode, lo: int, hi: int) -> range:
    if hi <= lo:
        return range(0)
    return range(lo // node.block_rows, -(-hi // node.block_rows))


def _clip(d: BlockDiff, start: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    rows = d.rows + start
    keep = (rows >= lo) & (rows < hi)
    return rows[keep], d.codes[keep]


def _every_row(get: Get, tb: TableNode, lo: int, hi: int) -> Iterator[Change]:
    blocks, batch = _Blocks(get, tb), _Batch(tb)
    for i in _block_span(tb, lo, hi):
        start, _ = tb.block_range(i)
        codes = blocks.codes(i)
        d = BlockDiff(np.arange(len(codes), dtype=np.int64), codes, 0, 1)
        yield from batch.add(*_clip(d, start, lo, hi))
    yield from batch.rest()


def _same_encoding(ta: TableNode, tb: TableNode) -> bool:
    return (ta.scheme, ta.row_nbytes, ta.block_rows, ta.fanout) == (
        tb.scheme, tb.row_nbytes, tb.block_rows, tb.fanout)


def _by_ids(get: Get, ta: TableNode, tb: TableNode, lo: int, hi: int, b_newer: bool,
            strict: bool) -> Iterator[Change]:
    """Same encoding: equal segments and blocks are skipped by id."""
    batch = _Batch(tb)
    exact = tb.scheme == "exact"
    span = _block_span(tb, lo, hi)
    per_seg = tb.fanout
    for j, sb in enumerate(tb.segment_ids):
        first, last = j * per_seg, (j + 1) * per_seg
        if last <= span.start or first >= span.stop:
            continue
        sa = ta.segment_ids[j] if j < len(ta.segment_ids) else None
        if sa == sb:
            continue
        seg_b = SegmentNode.decode(get(sb), sb)
        seg_a = SegmentNode.decode(get(sa), sa) if sa is not None else None
        blocks_a = seg_a.block_ids if seg_a is not None else ()
        for k, bid in enumerate(seg_b.block_ids):
            i = first + k
            if i not in span:
                continue
            aid = blocks_a[k] if k < len(blocks_a) else None
            if aid == bid:
                continue
            start, stop = tb.block_range(i)
            common = max(min(stop, ta.rows) - start, 0)
            if aid is None or common == 0:
                d = new_block(get, bid)
            else:
                assert seg_a is not None
                d = diff_block(get, aid, bid, common, exact=exact, b_newer=b_newer,
                               strict=strict, depths=(seg_a.depth[k], seg_b.depth[k]))
            yield from batch.add(*_clip(d, start, lo, hi))
    yield from batch.rest()


def _values(node: TableNode, codes: np.ndarray) -> np.ndarray:
    """The decoded rows of ``codes`` as bytes ``uint8[n, width * itemsize]``."""
    dtype = parse_dtype(node.dtype)
    if not node.width or not len(codes):
        return np.zeros((len(codes), 0), dtype=np.uint8)
    vals = decode_rows(torch.from_numpy(np.ascontiguousarray(codes)), node.scheme, dtype,
                       node.width)
    return vals.contiguous().view(torch.uint8).numpy().reshape(len(codes), -1)


def _by_values(get: Get, ta: TableNode, tb: TableNode, lo: int, hi: int) -> Iterator[Change]:
    """Another scheme or block geometry, same dtype and row shape: every block of b is
    decoded and compared by value with the rows of a's blocks over the same range."""
    batch = _Batch(tb)
    blocks_a, blocks_b = _Blocks(get, ta), _Blocks(get, tb)
    for i in _block_span(tb, lo, hi):
        start, stop = tb.block_range(i)
        codes_b = blocks_b.codes(i)
        common = max(min(stop, ta.rows) - start, 0)
        vals_a = np.concatenate(
            [_values(ta, blocks_a.codes(k))[max(start - s, 0):min(stop, e) - s]
             for k in _block_span(ta, start, start + common)
             for s, e in [ta.block_range(k)]]
            or [np.zeros((0, 0), dtype=np.uint8)])
        vals_b = _values(tb, codes_b[:common])
        differ = (np.flatnonzero(np.any(vals_a != vals_b, axis=1)) if vals_b.shape[1]
                  else np.empty(0, dtype=np.int64))
        rows = np.concatenate([differ, np.arange(common, stop - start)]).astype(np.int64)
        yield from batch.add(*_clip(BlockDiff(rows, codes_b[rows], 0, 2), start, lo, hi))
    yield from batch.rest()


def _table(get: Get, name: str, a_id: bytes | None, b_id: bytes | None,
           sel: tuple[int, int] | None, b_newer: bool, strict: bool) -> Iterator[Change]:
    if a_id == b_id:
        return
    if b_id is None:
        assert a_id is not None
        ta = TableNode.decode(get(a_id), a_id)
        yield Change(name, *_empty(ta), "dropped")
        return
    tb = TableNode.decode(get(b_id), b_id)
    lo, hi = sel if sel is not None else (0, tb.rows)
    hi = min(hi, tb.rows)
    if a_id is None:
        yield _structural("added", tb)
        yield from _every_row(get, tb, lo, hi)
        return
    ta = TableNode.decode(get(a_id), a_id)
    if (ta.dtype, ta.shape[1:]) != (tb.dtype, tb.shape[1:]):
        yield _structural("reshaped", tb)
        yield from _every_row(get, tb, lo, hi)
        return
    if ta.shape != tb.shape:
        yield _structural("reshaped", tb)
    if _same_encoding(ta, tb):
        yield from _by_ids(get, ta, tb, lo, hi, b_newer, strict)
    else:
        yield from _by_values(get, ta, tb, lo, hi)


def check_request(get: Get, get_step: Callable[[int], tuple[bytes, StepNode]], a, b, names,
                  rows) -> tuple[tuple[bytes, StepNode], tuple[bytes, StepNode], list[str],
                             dict[str, tuple[int, int]]]:
    """Check a ``changes`` call before anything is read past the step nodes: both steps
    kept (StepNotFound), ``names`` in one of them (TableNotFound), ``rows`` slices of step
    1 of a named table. Returns the two (root id, step node), the tables in walk order
    (b's order, then those only a holds) and the row ranges."""
    a, b = check_step(a), check_step(b)
    ra, rb = get_step(a), get_step(b)
    order = list(rb[1].tables) + [n for n in ra[1].tables if n not in set(rb[1].tables)]
    wanted, rows = check_selection(names, rows)
    if wanted is not None:
        for n in wanted:
            if n not in order:
                raise TableNotFound(n, b)
        order = [n for n in order if n in set(wanted)]
    ranges: dict[str, tuple[int, int]] = {}
    b_rows = {}
    for n, tid in zip(rb[1].tables, rb[1].table_ids):
        if rows and n in rows:
            b_rows[n] = TableNode.decode(get(tid), tid).rows
    for n, sel in (rows or {}).items():
        if n not in order:
            raise TableNotFound(n, b)
        start, stop, step = check_slice(sel, b_rows.get(n, 0), name=n)
        if step != 1:
            raise InvalidInput(f"rows[{n!r}]: changes take a contiguous slice (step 1)")
        ranges[n] = (start, max(start, stop))
    return ra, rb, order, ranges


def iter_changes(get: Get, a: int, b: int, ra: tuple[bytes, StepNode],
                 rb: tuple[bytes, StepNode], order: list[str],
                 ranges: dict[str, tuple[int, int]], *, strict: bool = False
                 ) -> Iterator[Change]:
    """The changes from step a to step b (checked by ``check_request``), table by table in
    ``order``; nothing when the two steps have one root."""
    if ra[0] == rb[0]:
        return
    ids_a = dict(zip(ra[1].tables, ra[1].table_ids))
    ids_b = dict(zip(rb[1].tables, rb[1].table_ids))
    for name in order:
        yield from _table(get, name, ids_a.get(name), ids_b.get(name), ranges.get(name),
                          b > a, strict)


def changes(core, a: int, b: int, *, names, rows, strict: bool = False) -> Iterator[Change]:
    """``CheckpointStore.changes``: checked at once (before the first ``next``), then read
    lazily. A step deleted and swept by gc while its changes are read is StepNotFound."""
    core.check_open()
    for s in (a, b):
        core.wait_step(check_step(s))
    objects = core.objects
    ra, rb, order, ranges = check_request(objects.get, lambda s: load_step(objects, s),
                                          a, b, names, rows)

    def walk() -> Iterator[Change]:
        with engine_errors():
            try:
                yield from iter_changes(objects.get, a, b, ra, rb, order, ranges,
                                        strict=strict)
            except StoreError as exc:
                for s, (root, _) in ((a, ra), (b, rb)):
                    if objects.root(root_name(s)) != root:
                        raise StepNotFound(s, f"step {s} was deleted while its changes "
                                              f"were read") from exc
                raise

    return walk()

"""The get pipeline, the one both handles run (CheckpointStore and DistributedStore
get_tables, get_state and load_state, and the DCP reader's load; docs/ARCHITECTURE.md,
"A put and a get"; docs/design/one-pipeline.md):

1. check: each rank's request ({table: what it reads}, or None for every table whole),
   built and checked locally by ``make()``; the ranks agree on them, so a rank whose
   check failed makes every rank raise its error (a world of one raises its own);
2. resolve (``answer``, on the coordinator): the step resolved, every rank's request
   checked against the step's manifest, and each rank answered through
   ``group.from_coordinator`` with the manifests of its tables, their row ranges and
   where the blocks overlapping them are (``reader.where``); a block several ranks'
   destination rows share is read by one of them, which sends the others their rows
   (``share``; ``reader.exchange``, cnrstore/distributed/boundary.py);
3. read: each rank decodes its rows (core/restore.py) from the object source those
   locations name (``reader.source``: a world of one reads its own store), then every
   rank enters the closing round (``reader.close``) with its read's error or none
   (its exchange settled first, whatever the read did);
4. seed: the diff bases of the tables read whole (``reader.seed``: a world of one
   seeds them from the stored step, core/seed.py ``seed_later``, so a restarted job's
   next put is incremental again; a rank's bases come through the coordinator at its
   next put instead, cnrstore/distributed/seed.py).

What differs with the number of ranks is the handle's ``group`` (core/group.py) and its
``reader`` (``Reader``; core/localread.py ``OwnStore`` for a world of one,
cnrstore/distributed/read.py ``RankBlocks`` for ranks). ``get_tables`` below is
CheckpointStore's entry into it (get_state and load_state in statestore.py build on it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cnrstore.core.handle import HandleState
from cnrstore.core.progress import Reporter, check_progress
from cnrstore.core.restore import block_span, check_slice, read_tables, row_range
from cnrstore.core.tablestate import parse_dtype
from cnrstore.core.validate import check_device, check_selection, check_step
from cnrstore.errors import CheckpointError, InvalidInput, StepNotFound, TableNotFound
from cnrstore.format.load import list_steps, load_step, load_table_manifest
from cnrstore.format.manifest import TableManifest, root_name
from engine import StoreError

__all__ = ["ALL", "Located", "Reader", "UNPICKED", "answer", "get", "get_tables",
           "out_bytes", "read_rows", "reporter", "request", "resolve", "share"]

Ranges = list[tuple[int, int]]
Tables = dict[str, tuple[TableManifest, Ranges]]

# The most row pieces a read's ranks send each other (their tags count them: a read's
# round number above, boundary.py); blocks past them are read by each rank.
MAX_SHARED = 1 << 20

# Request keys and entries that are not a table's reading.
ALL = "\x00all"     # every table of the step (never a table name: names are UTF-8)
UNPICKED = ("unpicked",)  # rows= of a table names= did not pick: TableNotFound


@dataclass
class Located:
    """What a rank reads of the resolved ``step``: its stored structure ``doc``
    (put_state; None for put_tables), ``tables`` {name: (manifest, row ranges)} in the
    order asked, the step's ``anchor`` (root name, node id) and the object source
    ``objects`` of those tables' blocks; ``swap``: the rows this rank sends and receives
    of the blocks it shares with other ranks (``share``), or None."""

    step: int
    doc: Any
    tables: Tables
    anchor: tuple[str, bytes]
    objects: Any
    swap: Any = None


class Reader(Protocol):
    """How a handle's ranks reach the blocks of a read (core/localread.py,
    cnrstore/distributed/read.py)."""

    def begin(self, h: Any) -> None:
        """Before the request round (a rank: open, its queued puts written)."""
        ...

    def store(self, h: Any) -> Any:
        """The coordinator's object store, which ``answer`` reads."""
        ...

    def blame(self, exc: CheckpointError, rank: int) -> BaseException:
        """``exc``, found in ``rank``'s request, as every rank raises it."""
        ...

    def where(self, objects: Any, oids: list[bytes], rank: int) -> Any:
        """What ``rank`` needs to read blocks ``oids`` (and their patch chains)."""
        ...

    def source(self, h: Any, where: Any) -> Any:
        """This rank's object source for the blocks ``where`` names."""
        ...

    def exchange(self, h: Any, plan: Any) -> Any:
        """This rank's side of ``share``'s plan (only ever called with several ranks):
        ``fill``ed by the read, ``settle``d by ``get`` whatever the read did."""
        ...

    def close(self, h: Any, err: BaseException | None, what: str) -> None:
        """The closing round: every rank raises the lowest rank's error, or returns."""
        ...

    def seed(self, h: Any, loc: Located, rows: Mapping | None) -> None:
        """Diff bases of the tables read whole (``rows`` names those read in part)."""
        ...


def request(names: list[str] | None, rows: Mapping, *, unpicked: bool = False) -> dict:
    """The request entries of a read of ``names`` (None: every table) and ``rows``
    ({table: slice}), as check_selection returned them. ``unpicked``: a table in
    ``rows`` that ``names`` did not pick is TableNotFound (CheckpointStore), rather
    than read too (DistributedStore)."""
    req: dict[str, Any] = {n: None for n in (names or ())}
    for n, sel in rows.items():
        if unpicked and names is not None and n not in req:
            req[n] = UNPICKED
        else:
            req[n] = ("rows", sel)
    if names is None:
        req[ALL] = True  # every table, whole unless rows= names it
    return req


def get(h: Any, step: int | None, what: str, make: Callable[[], Any],
        read: Callable[[Located, Reporter], Any], *, progress: Any = None,
        rows: Mapping | None = None, finish: bool = True) -> Any:
    """The pipeline: this rank's request ``make()`` checked and resolved (``resolve``),
    ``read(located, report)`` (its error enters the closing round), the report finished
    (unless ``finish`` is False: the caller finishes ``report`` itself) and the bases of
    the tables read whole seeded. Returns what ``read`` returned."""
    loc = resolve(h, step, what, make)
    err, out = None, None
    report = reporter(h, progress, loc.tables, rows)
    try:
        out = read(loc, report)
    except BaseException as exc:
        err = exc
    if loc.swap is not None:  # a peer waits for this rank's rows, whatever the read did
        err = loc.swap.settle(err)
    h.reader.close(h, err, f"{what}: read")
    if finish:
        report.finish()
    h.reader.seed(h, loc, rows)
    return out


def resolve(h: Any, step: int | None, what: str, make: Callable[[], Any]) -> Located:
    """The check and resolve stages: every rank's request agreed on, the coordinator's
    answer to this rank, and its object source."""
    reader: Reader = h.reader
    reader.begin(h)
    err, req = None, None
    try:
        req = (step if step is None else check_step(step), make())
    except BaseException as exc:
        err = exc
    reqs = h.group.agree(err, what, req)
    s, doc, tables, anchor, where, plan = h.group.from_coordinator(
        what, lambda: answer(reader, reader.store(h), reqs, what))
    swap = None if plan is None else reader.exchange(h, plan)
    try:
        objects = reader.source(h, where)
    except BaseException as exc:  # enter the closing round with it: every rank raises
        reader.close(h, exc if swap is None else swap.settle(exc), f"{what}: read")
        raise
    return Located(s, doc, tables, anchor, objects, swap)


def answer(reader: Reader, objects: Any, reqs: list[tuple[Any, Any]], what: str
           ) -> list[tuple]:
    """The coordinator's answer to every rank's (step, request): per rank (step,
    structure, {name: (manifest, ranges)}, anchor, where its blocks are, its part of the
    blocks shared with other ranks or None: ``share``)."""
    if len({r[0] for r in reqs}) > 1:
        raise InvalidInput(f"{what}: the ranks asked for different steps "
                           f"{sorted({str(r[0]) for r in reqs})}")
    s = reqs[0][0]
    if s is None:
        steps = list_steps(objects)
        if not steps:
            raise StepNotFound(-1, "the store holds no steps")
        s = steps[-1]
    oid, node = load_step(objects, s)

    def names(r: Any) -> Iterable[str]:
        return node.tables if r is None or r.get(ALL) else [n for n in r if n != ALL]

    for rank, (_, r) in enumerate(reqs):
        for n in (r or {}):
            if n != ALL and (n not in node.tables or r[n] == UNPICKED):
                raise reader.blame(TableNotFound(n, s), rank)
    wanted = {n for _, r in reqs for n in names(r)}
    by_name = dict(zip(node.tables, node.table_ids))
    # Each table's manifest read once, whatever ranks ask for it (load_manifest would
    # read the step node a second time).
    manifests = {n: load_table_manifest(objects, by_name[n])
                 for n in node.tables if n in wanted}
    asked: list[dict[str, tuple[TableManifest, Ranges, bool]]] = []
    for rank, (_, r) in enumerate(reqs):
        mine: dict[str, tuple[TableManifest, Ranges, bool]] = {}
        for n in names(r):
            spec = None if r is None else r.get(n)
            try:
                ranges = _ranges(n, manifests[n].node, spec)
            except CheckpointError as exc:
                raise reader.blame(exc, rank) from None
            mine[n] = (manifests[n], ranges, spec is not None and spec[0] == "shared")
        asked.append(mine)
    plans, skips = share(asked)
    out = []
    for rank, mine in enumerate(asked):
        oids: list[bytes] = []
        for n, (tm, ranges, _) in mine.items():
            for lo, hi in ranges:
                first, last = block_span(tm, slice(lo, hi))
                # a block read by another rank for this one is its range's first or last
                first += (n, first) in skips[rank] and last > first
                last -= (n, last - 1) in skips[rank] and last > first
                oids.extend(tm.block_ids[first:last])
        out.append((s, node.state, {n: (tm, ranges) for n, (tm, ranges, _) in mine.items()},
                    (root_name(s), oid), reader.where(objects, oids, rank), plans[rank]))
    return out


def share(asked: list[dict[str, tuple[TableManifest, Ranges, bool]]]
          ) -> tuple[list[Any], list[set[tuple[str, int]]]]:
    """Which rank reads each block that several ranks' destination rows share, from every
    rank's {table: (manifest, row ranges, shareable)}: per rank (its plan, or None; the
    blocks (table, index) it does not read). A block is shared where two or more ranks
    want rows of it, every range over it is shareable (a "shared" request entry: rows the
    rank fills in one pass, distributed/boundary.py) and no two ranges over it overlap
    (replicas read their own). It is read by the rank holding most of its rows: a block
    costs its reader the same bytes whoever that is, so the choice only decides how many
    rows cross between ranks (ties: the rank asking fewer rows in all, then the lowest).
    A plan is (receive, send): (tag, source rank, table, range index, lo, hi, bytes) of
    each range piece this rank gets, (tag, rank, table, lo, hi, bytes) of each it sends."""
    world = len(asked)
    plans: list[Any] = [([], []) for _ in range(world)]
    skips: list[set[tuple[str, int]]] = [set() for _ in range(world)]
    load = [sum(hi - lo for _, ranges, _ in a.values() for lo, hi in ranges) for a in asked]
    tag = 0
    for n in dict.fromkeys(n for a in asked for n, e in a.items() if e[2]):
        tm = next(a[n][0] for a in asked if n in a)
        R, row_bytes = tm.node.block_rows, out_bytes(tm, slice(0, 1)) if tm.node.rows else 0
        # Only a block a range holds part of can be shared (one a range holds whole is
        # another rank's only where their rows overlap): each range's first and last.
        given = [(lo, hi, r, k, a[n][2]) for r, a in enumerate(asked) if n in a
                 for k, (lo, hi) in enumerate(a[n][1]) if hi > lo]
        ends = {b for lo, hi, *_ in given for b in (lo // R, (hi - 1) // R)}
        wants: dict[int, list[tuple[int, int, int, int]]] = {}
        closed: set[int] = set()
        for lo, hi, r, k, ok in given:
            for b in ends:
                if lo < b * R + R and hi > b * R:
                    if ok:
                        wants.setdefault(b, []).append((max(lo, b * R), min(hi, b * R + R),
                                                        r, k))
                    else:
                        closed.add(b)
        for b in sorted(wants):
            got = sorted(wants[b])
            ranks = sorted({r for _, _, r, _ in got})
            if (len(ranks) < 2 or b in closed or not row_bytes or tag + len(got) > MAX_SHARED
                    or any(x[0] < y[1] for x, y in zip(got[1:], got))):
                continue
            held = {r: sum(hi - lo for lo, hi, q, _ in got if q == r) for r in ranks}
            src = min(ranks, key=lambda r: (-held[r], load[r], r))
            for lo, hi, r, k in got:
                if r != src:
                    plans[r][0].append((tag, src, n, k, lo, hi, (hi - lo) * row_bytes))
                    plans[src][1].append((tag, r, n, lo, hi, (hi - lo) * row_bytes))
                    skips[r].add((n, b))
                    tag += 1
    return [p if p[0] or p[1] else None for p in plans], skips


def _ranges(name: str, node: Any, spec: Any) -> Ranges:
    """Row ranges of a request entry, checked against the stored table: None (every
    row), ("rows", slice) or ("slice", (start, stop, step)), ("whole", shape, dtype) (a
    destination tensor), ("shards", [(lo, hi, row shape, dtype)]) (destination rows; as
    "shared": destination rows a rank fills in one pass, which may share blocks with
    other ranks', ``share``)."""
    if spec is None:
        return [(0, node.rows)]
    if spec[0] == "whole":
        shape, dtype = tuple(spec[1]), spec[2]
        if shape != node.shape or dtype != node.dtype:
            raise InvalidInput(f"{name!r} is {shape} {dtype}; the step holds {node.shape} "
                               f"{node.dtype}; nothing was written")
        return [(0, node.rows)]
    if spec[0] in ("rows", "slice"):
        sel = spec[1] if spec[0] == "rows" else slice(*spec[1])
        start, stop, step = check_slice(sel, node.rows, name=name)
        lo, hi, _ = row_range(slice(start, stop, step), node.rows)
        return [(lo, hi)]
    out = []
    for lo, hi, row_shape, dtype in spec[1]:   # shards and shared: rows, checked
        if hi > node.rows or tuple(row_shape) != node.shape[1:] or dtype != node.dtype:
            raise InvalidInput(f"{name!r}: a shard of rows {lo}..{hi} with rows of "
                               f"{tuple(row_shape)} {dtype} does not fit the stored "
                               f"{node.shape} {node.dtype}; nothing was written")
        out.append((lo, hi))
    return out


def reporter(h: Any, progress: Any, tables: Tables, rows: Mapping | None = None
             ) -> Reporter:
    """``progress`` over the bytes this rank decodes of ``tables`` (``rows``: the
    slices asked for, if any): each rank reports its own reads."""
    return Reporter(progress, sum(
        out_bytes(tm, rows[n]) if rows and n in rows else
        sum(out_bytes(tm, slice(lo, hi)) for lo, hi in ranges)
        for n, (tm, ranges) in tables.items()), min_total=h.options.progress_min_bytes)


def read_rows(h: Any, device: Any, rows: Mapping | None) -> Callable[[Located, Reporter],
                                                                     dict]:
    """The read of get_tables without ``out=``: every table of the answer into fresh
    tensors on ``device``, whole or its ``rows`` slice. (The device was checked by the
    request; checked here again, a rank that did not check it still closes the read.)"""
    def read(loc: Located, report: Reporter) -> dict:
        wanted = [(tm, (rows or {}).get(n)) for n, (tm, _) in loc.tables.items()]
        done = report.add if report.fn is not None else None
        return dict(zip(loc.tables, read_tables(loc.objects, h.pool, wanted,
                                                check_device(device), done=done)))
    return read


def get_tables(core: HandleState, step: int | None, *, names: Any, rows: Any,
               device: Any, progress: Any = None) -> dict:
    """CheckpointStore.get_tables without ``out=`` (statestore.get_into has it)."""
    core.check_open()
    check_progress(progress)
    if step is None:
        return core.latest(None, lambda s: get_tables(core, s, names=names, rows=rows,
                                                      device=device, progress=progress))
    names, rows = check_selection(names, rows)
    device = check_device(device)
    step = core.resolve_step(step)
    req = request(names, rows, unpicked=True)
    try:
        return get(core, step, "get_tables", lambda: req, read_rows(core, device, rows),
                   progress=progress, rows=rows)
    except StoreError as exc:
        # Another handle or process deleted the step and a gc swept its objects while they
        # were read: the step is gone, not damaged (the engine's ObjectNotFound escaped).
        if not _step_still_there(core.objects, step):
            raise StepNotFound(step, f"step {step} was deleted while it was read") from exc
        raise


def out_bytes(tm: Any, sel: slice | None) -> int:
    """Bytes of the tensor a read of ``tm`` (rows ``sel``) returns."""
    node = tm.node
    rows = node.rows if sel is None else len(range(*sel.indices(node.rows)))
    return rows * math.prod(node.shape[1:]) * parse_dtype(node.dtype).itemsize


def _step_still_there(objects: Any, step: int) -> bool:
    """False when ``step`` was dropped (by another process) after it was resolved."""
    try:
        return objects.root(root_name(step)) is not None
    except StoreError:
        return True

"""The get pipeline, the one both handles run (CheckpointStore and DistributedStore
get_tables, get_state and load_state, and the DCP reader's load; docs/ARCHITECTURE.md,
"A put and a get"; docs/design/one-pipeline.md):

1. check: each rank's request ({table: what it reads}, or None for every table whole),
   built and checked locally by ``make()``; the ranks agree on them, so a rank whose
   check failed makes every rank raise its error (a world of one raises its own);
2. resolve (``answer``, on the coordinator): the step resolved, every rank's request
   checked against the step's manifest, and each rank answered through
   ``group.from_coordinator`` with the manifests of its tables, their row ranges and
   where the blocks overlapping them are (``reader.where``);
3. read: each rank decodes its rows (core/restore.py) from the object source those
   locations name (``reader.source``: a world of one reads its own store), then every
   rank enters the closing round (``reader.close``) with its read's error or none;
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
from cnrstore.core.restore import check_slice, read_tables, row_range
from cnrstore.core.tablestate import parse_dtype
from cnrstore.core.validate import check_device, check_selection, check_step
from cnrstore.errors import CheckpointError, InvalidInput, StepNotFound, TableNotFound
from cnrstore.format.load import list_steps, load_step, load_table_manifest
from cnrstore.format.manifest import TableManifest, root_name
from engine import StoreError

__all__ = ["ALL", "Located", "Reader", "UNPICKED", "answer", "get", "get_tables",
           "out_bytes", "read_rows", "reporter", "request", "resolve"]

Ranges = list[tuple[int, int]]
Tables = dict[str, tuple[TableManifest, Ranges]]

# Request keys and entries that are not a table's reading.
ALL = "\x00all"     # every table of the step (never a table name: names are UTF-8)
UNPICKED = ("unpicked",)  # rows= of a table names= did not pick: TableNotFound


@dataclass
class Located:
    """What a rank reads of the resolved ``step``: its stored structure ``doc``
    (put_state; None for put_tables), ``tables`` {name: (manifest, row ranges)} in the
    order asked, the step's ``anchor`` (root name, node id) and the object source
    ``objects`` of those tables' blocks."""

    step: int
    doc: Any
    tables: Tables
    anchor: tuple[str, bytes]
    objects: Any


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
    s, doc, tables, anchor, where = h.group.from_coordinator(
        what, lambda: answer(reader, reader.store(h), reqs, what))
    try:
        objects = reader.source(h, where)
    except BaseException as exc:  # enter the closing round with it: every rank raises
        reader.close(h, exc, f"{what}: read")
        raise
    return Located(s, doc, tables, anchor, objects)


def answer(reader: Reader, objects: Any, reqs: list[tuple[Any, Any]], what: str
           ) -> list[tuple]:
    """The coordinator's answer to every rank's (step, request): per rank (step,
    structure, {name: (manifest, ranges)}, anchor, where its blocks are)."""
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
    out = []
    for rank, (_, r) in enumerate(reqs):
        mine: Tables = {}
        oids: list[bytes] = []
        for n in names(r):
            tm = manifests[n]
            spec = None if r is None else r.get(n)
            try:
                ranges = _ranges(n, tm.node, spec)
            except CheckpointError as exc:
                raise reader.blame(exc, rank) from None
            for lo, hi in ranges:
                if hi > lo:
                    first, last = lo // tm.node.block_rows, -(-hi // tm.node.block_rows)
                    oids.extend(tm.block_ids[first:last])
            mine[n] = (tm, ranges)
        out.append((s, node.state, mine, (root_name(s), oid),
                    reader.where(objects, oids, rank)))
    return out


def _ranges(name: str, node: Any, spec: Any) -> Ranges:
    """Row ranges of a request entry, checked against the stored table: None (every
    row), ("rows", slice) or ("slice", (start, stop, step)), ("whole", shape, dtype) (a
    destination tensor), ("shards", [(lo, hi, row shape, dtype)]) (destination rows)."""
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
    for lo, hi, row_shape, dtype in spec[1]:   # shards: rows, checked
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

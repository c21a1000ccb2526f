"""Collective reads of a DistributedStore (get_tables; statestore.py builds get_state and
load_state on them). Each rank asks for the rows it needs; the coordinator resolves the step,
checks every rank's request against the manifest and sends each rank the table manifests
and the locations of exactly the blocks (with their patch chains) that overlap its rows;
each rank then decodes with core/restore.py. Every rank returns, or every rank raises."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from cnrstore.codec.layout import dtype_name
from cnrstore.core.restore import (
    check_slice,
    read_into,
    read_table,
    read_tables,
    row_range,
    table_hints,
)
from cnrstore.core.validate import check_destination, check_device, check_selection, check_step
from cnrstore.distributed import transfer
from cnrstore.distributed.comm import rebuild_error, wire_error
from cnrstore.distributed.shard import Shard
from cnrstore.errors import (
    CheckpointError,
    InvalidInput,
    InvalidType,
    StepNotFound,
    TableNotFound,
)
from cnrstore.format.load import list_steps, load_manifest, load_step

# The DistributedStore (cnrstore/distributed/store.py, which imports this module): typed loosely
# so the layers test sees no import cycle.
DistributedStore = Any

__all__ = ["get_tables", "collective_read", "finish_read", "fill_dest", "dest_hints"]

Ranges = list[tuple[int, int]]
_ALL = "\x00all"  # request key: every table of the step (never a table name: names are UTF-8)


def collective_read(ds: DistributedStore, step: Any, request: Any, what: str,
                     make: Any) -> tuple[int, Any, dict, Any]:
    """One read round. ``request`` is this rank's {name: ranges or None (all rows) or
    ("whole", shape, dtype)}, or None for every table, whole (computed by ``make()``
    locally so that its errors are agreed on). Returns (step, structure doc, {name:
    (TableManifest, ranges)}, object source)."""
    ds.check_open()
    ds.drain()
    err, req = None, None
    try:
        req = (step if step is None else check_step(step), make())
    except BaseException as exc:
        err = exc
    reqs = ds.comm.agree(err, what, req)

    def answer() -> list:
        objects = ds.local.objects
        if len({r[0] for r in reqs}) > 1:
            raise InvalidInput(f"{what}: the ranks asked for different steps "
                               f"{sorted({str(r[0]) for r in reqs})}")
        s = reqs[0][0]
        if s is None:
            steps = list_steps(objects)
            if not steps:
                raise StepNotFound(-1, "the store holds no steps")
            s = steps[-1]
        _, node = load_step(objects, s)
        def names(r: Any) -> Iterable[str]:
            return node.tables if r is None or r.get(_ALL) else [n for n in r if n != _ALL]

        wanted = {n for _, r in reqs for n in names(r)}
        for rank, (_, r) in enumerate(reqs):
            for n in (r or {}):
                if n != _ALL and n not in node.tables:
                    raise rebuild_error(wire_error(TableNotFound(n, s)), rank)
        manifest = load_manifest(objects, s, names=[n for n in node.tables if n in wanted])
        out = []
        for rank, (_, r) in enumerate(reqs):
            mine: dict[str, tuple] = {}
            oids: list[bytes] = []
            for n in names(r):
                tm = manifest.tables[n]
                spec = None if r is None else r.get(n)
                try:
                    ranges = _ranges(n, tm.node, spec)
                except CheckpointError as exc:
                    raise rebuild_error(wire_error(exc), rank) from None
                for lo, hi in ranges:
                    if hi > lo:
                        first, last = lo // tm.node.block_rows, -(-hi // tm.node.block_rows)
                        oids.extend(tm.block_ids[first:last])
                mine[n] = (tm, ranges)
            where = None if rank == 0 or not oids else transfer.locate(objects, oids)
            out.append((s, node.state, mine, where))
        return out

    s, doc, tables, where = ds.from_coordinator(ds.comm, what, answer)
    try:
        if ds.is_coordinator:
            objects: Any = ds.local.objects
        else:
            objects = ds.readers.source(where) if where is not None else None
    except BaseException as exc:  # enter the closing round with it: every rank raises
        finish_read(ds, exc, f"{what}: read")
        raise
    return s, doc, tables, objects


def _ranges(name: str, node: Any, spec: Any) -> Ranges:
    """Row ranges of a request entry, checked against the stored table."""
    if spec is None:
        return [(0, node.rows)]
    if spec[0] == "whole":
        shape, dtype = tuple(spec[1]), spec[2]
        if shape != node.shape or dtype != node.dtype:
            raise InvalidInput(f"{name!r} is {shape} {dtype}; the step holds {node.shape} "
                               f"{node.dtype}; nothing was written")
        return [(0, node.rows)]
    if spec[0] == "slice":
        start, stop, step = check_slice(slice(*spec[1]), node.rows, name=name)
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


def finish_read(ds: DistributedStore, err: BaseException | None, what: str) -> None:
    """The closing round of a read: every rank raises the lowest rank's error, or, when
    the only errors were packs gone under a rank, the signal ``transfer.again`` retries."""
    moved = getattr(ds, "retry_moved", False) and transfer.moved(err)
    if any(ds.comm.agree(None if moved else err, what, moved)):
        transfer.moved_everywhere(what)


def get_tables(ds: DistributedStore, step: Any, *, names: Any, rows: Any, device: Any,
               out: Any) -> dict:
    def make() -> dict:
        if out is not None:
            if names is not None or rows is not None:
                raise InvalidInput("get_tables: out= names the tables; not with names= or rows=")
            if not isinstance(out, Mapping):
                raise InvalidType("out must be a mapping table name -> tensor or Shard")
            return {n: _out_spec(n, t) for n, t in out.items()}
        check_device(device)
        wanted, sel_rows = check_selection(names, rows)
        req: dict[str, Any] = {n: None for n in (wanted or ())}
        for n, sel in sel_rows.items():
            if not isinstance(sel, slice):
                raise InvalidType(f"rows[{n!r}] must be a slice, got {type(sel).__name__}")
            req[n] = ("slice", (sel.start, sel.stop, sel.step))
        if names is None:
            req[_ALL] = True  # every table, whole unless rows= names it
        return req

    s, _, tables, objects = collective_read(ds, step, None, "get_tables", make)
    result: dict = {}
    err = None
    try:
        if out is not None:
            dests = [(tm, out[n]) for n, (tm, _) in tables.items()]
            for (n, (tm, ranges)), hint in zip(tables.items(), dest_hints(objects, dests)):
                fill_dest(ds, objects, tm, ranges, out[n], started=hint)
                result[n] = out[n]
        else:
            wanted = [(tm, (rows or {}).get(n)) for n, (tm, _) in tables.items()]
            result = dict(zip(tables, read_tables(objects, ds.pool, wanted,
                                                  check_device(device))))
    except BaseException as exc:
        err = exc
    finish_read(ds, err, "get_tables: read")
    return result


def _out_spec(name: str, t: Any) -> Any:
    if isinstance(t, Shard):
        check_destination(f"out[{name!r}]", t.local)
        return ("shards", [(t.row_offset, t.row_end, tuple(t.local.shape[1:]),
                            str(t.local.dtype).removeprefix("torch."))])
    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"out[{name!r}] must be a torch.Tensor or Shard, got "
                          f"{type(t).__name__}")
    check_destination(f"out[{name!r}]", t)
    return ("whole", tuple(t.shape), str(t.dtype).removeprefix("torch."))


def dest_hints(objects: Any, dests: list[tuple[Any, Any]]) -> list[Any]:
    """The ``started`` of each (table manifest, destination) of a read that fills them in
    this order: one read-ahead over all their blocks, so the disk goes on reading the next
    table while the decode finishes one (one per table drained it between tables)."""
    def rows(dest: Any) -> slice | None:
        return slice(dest.row_offset, dest.row_end) if isinstance(dest, Shard) else None

    return table_hints(objects, [(tm, rows(d)) for tm, d in dests])


def fill_dest(ds: DistributedStore, objects: Any, tm: Any, ranges: Ranges, dest: Any, *,
              started: Any = None) -> None:
    if isinstance(dest, Shard):
        if dest.local.shape[0]:
            local = dest.local.detach()
            rows = slice(dest.row_offset, dest.row_end)
            if (local.is_contiguous() and local.device.type == "cpu"
                    and dtype_name(local.dtype) == tm.node.dtype):
                # decoded in place (read_table fills rows x width): no second copy
                read_table(objects, tm, ds.pool, rows=rows, started=started,
                           into=local.view(local.shape[0], math.prod(local.shape[1:])))
            else:
                t, _, _ = read_table(objects, tm, ds.pool, rows=rows, started=started)
                local.copy_(t.view(local.shape))
        return
    read_into(objects, tm, ds.pool, dest.detach(), started=started)

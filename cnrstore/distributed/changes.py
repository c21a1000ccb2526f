"""Collective ``changes`` of a DistributedStore: each rank asks for the tables and rows it
serves (``rows=``, its own range), the coordinator checks every request against its index
and sends each rank the two step nodes and the locations of the named tables' objects
(located from the index, nothing read); each rank then walks the two DAGs itself with
cnrstore/core/changes.py, reading only the objects that walk needs, by location. Every
rank returns its changes, or every rank raises the lowest rank's error."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from cnrstore.core.changes import Change, check_request, iter_changes
from cnrstore.core.validate import check_selection, check_step
from cnrstore.distributed import transfer
from cnrstore.distributed.comm import rebuild_error, wire_error
from cnrstore.errors import InvalidInput, InvalidType
from cnrstore.format.load import load_step

DistributedStore = Any  # typed loosely, as in read.py: no import cycle with store.py

__all__ = ["changes"]


def _request(a: Any, b: Any, names: Any, rows: Any, strict: bool) -> tuple:
    a, b = check_step(a), check_step(b)
    names, rows = check_selection(names, rows)
    spec = {}
    for n, sel in rows.items():
        if not isinstance(sel, slice):
            raise InvalidType(f"rows[{n!r}] must be a slice, got {type(sel).__name__}")
        spec[n] = (sel.start, sel.stop, sel.step)
    return a, b, names, spec, bool(strict)


def _round(ds: DistributedStore, reqs: list) -> Any:
    def answer() -> list:
        objects = ds.local.objects
        if len({(r[0], r[1]) for r in reqs}) > 1:
            raise InvalidInput("changes: the ranks asked for different steps "
                               f"{sorted({(r[0], r[1]) for r in reqs})}")
        out = []
        for rank, (a, b, names, spec, _) in enumerate(reqs):
            rows = {n: slice(*s) for n, s in spec.items()}
            try:
                ra, rb, order, ranges = check_request(
                    objects.get, lambda s: load_step(objects, s), a, b, names, rows)
            except BaseException as exc:
                raise rebuild_error(wire_error(exc), rank) from None
            ids = dict(zip(ra[1].tables, ra[1].table_ids))
            ids_b = dict(zip(rb[1].tables, rb[1].table_ids))
            oids = sorted({t[n] for t in (ids, ids_b) for n in order if n in t})
            where = None if rank == 0 or not oids else transfer.locate(objects, oids)
            out.append((ra, rb, order, ranges, where))
        return out

    return ds.from_coordinator(ds.comm, "changes", answer)


def _collect(ds: DistributedStore, req: tuple) -> list[Change]:
    ds.check_open()
    ds.drain()
    err = None
    try:
        req = _request(*req)
    except BaseException as exc:
        err = exc
    reqs = ds.comm.agree(err, "changes", req)
    a, b, _, _, strict = reqs[ds.rank]
    ra, rb, order, ranges, where = _round(ds, reqs)
    got: list[Change] = []
    err = None
    try:
        objects = ds.local.objects if ds.is_coordinator else (
            ds.readers.source(where) if where is not None else None)
        get = objects.get if objects is not None else _nothing
        got = list(iter_changes(get, a, b, ra, rb, order, ranges, strict=strict))
    except BaseException as exc:
        err = exc
    moved = getattr(ds, "retry_moved", False) and transfer.moved(err)
    if any(ds.comm.agree(None if moved else err, "changes: read", moved)):
        transfer.moved_everywhere("changes: read")
    return got


def _nothing(oid: bytes) -> Any:
    raise InvalidInput(f"object {oid.hex()} was not located for this rank")


def changes(ds: DistributedStore, a: Any, b: Any, names: Any, *, rows: Any,
            strict: bool) -> Iterator[Change]:
    """DistributedStore.changes: collective; each rank gets the changes of its own names
    and rows, read by the rank itself (held in memory until the call returns, so that a
    read error on one rank is raised on every rank)."""
    req = (a, b, names, rows, strict)
    return iter(transfer.again(ds, lambda: _collect(ds, req)))

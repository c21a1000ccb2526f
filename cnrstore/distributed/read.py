"""Collective reads (get_tables, get_state, load_state) and put_state of a
DistributedStore. Each rank asks for the rows it needs; the coordinator resolves the step,
checks every rank's request against the manifest and sends each rank the table manifests
and the locations of exactly the blocks (with their patch chains) that overlap its rows;
each rank then decodes with core/restore.py. Every rank returns, or every rank raises."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from cnrstore.core.restore import check_slice, read_into, read_table, read_tables, row_range
from cnrstore.core.state import (
    MAX_DEPTH,
    SEP,
    check_structure,
    fill,
    flatten,
    lazy_tables,
    stored_leaf,
    unflatten,
)
from cnrstore.core.validate import check_destination, check_device, check_step
from cnrstore.distributed import put as dput
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
from cnrstore.format.manifest import list_steps, load_manifest, load_step

# The DistributedStore (cnrstore/distributed/store.py, which imports this module): typed loosely
# so the layers test sees no import cycle.
DistributedStore = Any

__all__ = ["get_tables", "get_state", "load_state", "put_state"]

Ranges = list[tuple[int, int]]
_ALL = "\x00all"  # request key: every table of the step (never a table name: names are UTF-8)


def _collective_read(ds: DistributedStore, step: Any, request: Any, what: str,
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
        _finish(ds, exc, f"{what}: read")
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


def _finish(ds: DistributedStore, err: BaseException | None, what: str) -> None:
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
        if names is not None and (isinstance(names, str) or not isinstance(names, Iterable)):
            raise InvalidType("names must be an iterable of table names (not a str)")
        if rows is not None and not isinstance(rows, Mapping):
            raise InvalidType("rows must be a mapping table name -> slice")
        req: dict[str, Any] = {n: None for n in (names or ())}
        for n, sel in (rows or {}).items():
            if not isinstance(sel, slice):
                raise InvalidType(f"rows[{n!r}] must be a slice, got {type(sel).__name__}")
            req[n] = ("slice", (sel.start, sel.stop, sel.step))
        if names is None:
            req[_ALL] = True  # every table, whole unless rows= names it
        return req

    s, _, tables, objects = _collective_read(ds, step, None, "get_tables", make)
    result: dict = {}
    err = None
    try:
        if out is not None:
            for n, (tm, ranges) in tables.items():
                _fill(ds, objects, tm, ranges, out[n])
                result[n] = out[n]
        else:
            wanted = [(tm, (rows or {}).get(n)) for n, (tm, _) in tables.items()]
            result = dict(zip(tables, read_tables(objects, ds.pool, wanted,
                                                  check_device(device))))
    except BaseException as exc:
        err = exc
    _finish(ds, err, "get_tables: read")
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


def _fill(ds: DistributedStore, objects: Any, tm: Any, ranges: Ranges, dest: Any) -> None:
    if isinstance(dest, Shard):
        if dest.local.shape[0]:
            t, _, _ = read_table(objects, tm, ds.pool, rows=slice(dest.row_offset, dest.row_end))
            dest.local.detach().copy_(t.view(dest.local.shape))
        return
    read_into(objects, tm, ds.pool, dest.detach())


# -- whole states ----------------------------------------------------------------------

def _sharded(state: Any, shard_leaf: Any) -> tuple[Any, dict[str, Any]]:
    """``state`` with Shard / DTensor / ShardedTensor leaves replaced by data-less tensors
    of their global shape (so core/state.py flattens it), and those leaves by table name."""
    found: dict[str, Any] = {}

    def walk(value: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:  # before Python's own recursion limit (a RecursionError)
            raise InvalidInput(f"state nests deeper than {MAX_DEPTH} at {path[:200]!r}... "
                               "(a cycle?)")
        shards = None
        if isinstance(value, Shard):
            shards = [value]
        elif shard_leaf is not None and not isinstance(value, (Mapping, list, tuple, str,
                                                               bytes)):
            shards = shard_leaf(value)
        if shards is not None:
            found[path] = value
            if isinstance(value, Shard):
                shape = (value.rows, *value.local.shape[1:])
                dtype = value.local.dtype
            else:
                shape, dtype = tuple(value.shape), value.dtype
            return torch.empty(shape, dtype=dtype, device="meta")
        if isinstance(value, Mapping):
            return {k: walk(v, f"{path}{SEP}{k}" if path else str(k), depth + 1)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{path}{SEP}{i}" if path else str(i), depth + 1)
                     for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        return value

    return walk(state, ""), found


def _uniform(ds: DistributedStore, state: Any, what: str) -> Any:
    """One nesting on every rank: TorchRec's state names a table's optimizer state only
    where a rank holds its rows (cnrstore.distributed.leaves.uniform)."""
    from cnrstore.distributed.leaves import uniform

    # Every rank enters the same rounds: whether states are mappings is agreed first.
    kinds = ds.comm.agree(None, what, isinstance(state, Mapping))
    if not any(kinds):
        return state
    if not all(kinds):
        raise InvalidType(f"{what}: the state is a mapping on ranks "
                          f"{[r for r, k in enumerate(kinds) if k]} only")
    entered: list[bool] = []

    def gather(mine: Any) -> list:
        entered.append(True)
        return ds.comm.agree(None, what, mine)

    try:
        return uniform(state, gather=gather)
    except BaseException as exc:
        if not entered:  # failed before the round: enter it with the error, so every
            ds.comm.agree(exc, what, None)  # rank raises it (this one included)
        raise


def put_state(ds: DistributedStore, step: Any, state: Any, *, quant: Any, metadata: Any,
              blocking: bool, touched: Any) -> Any:
    state = _uniform(ds, state, "put_state: structure")
    err = None
    try:  # local checks: a rank that fails here must still enter the put's rounds
        plain, sharded = _sharded(state, ds.shard_leaf)
        flat = flatten(plain)
        tables = dict(flat.tables)
        tables.update(sharded)
        if quant is None:
            quant = "exact"
        elif isinstance(quant, str) and quant != "exact":
            quant = {"*": quant}
        # touched= may be TorchRec's ModelDeltaTracker (cnrstore/distributed/torchrec.py)
        from cnrstore.distributed.torchrec import resolve_touched

        touched, done = resolve_touched(touched, state)
    except BaseException as exc:
        err = exc
    ds.comm.agree(err, "put_state: flatten", None)
    info = dput.put(ds, step, tables, quant=quant, metadata=metadata, blocking=blocking,
                    touched=touched, state=flat.doc)
    done()
    return info


def get_state(ds: DistributedStore, step: Any, *, device: Any) -> Any:
    s, doc, tables, objects = _collective_read(ds, step, None, "get_state",
                                               lambda: check_device(device) and None)
    result: dict = {}
    err = None
    try:
        result = dict(zip(tables, read_tables(objects, ds.pool,
                                              [(tm, None) for tm, _ in tables.values()],
                                              check_device(device))))
        if doc is not None:
            check_structure(doc)
            result = unflatten(doc, stored_leaf(s, result))
    except BaseException as exc:
        err = exc
    _finish(ds, err, "get_state: read")
    return result


def load_state(ds: DistributedStore, step: Any, state: Any, *, strict: bool) -> Any:
    state = _uniform(ds, state, "load_state: structure")
    box: dict[str, Any] = {}

    def make() -> dict:
        plain, sharded = _sharded(state, ds.shard_leaf)
        flat = flatten(plain)
        box["flat"], box["sharded"] = flat, sharded
        req: dict[str, Any] = {}
        for n, t in flat.tables.items():
            leaf = sharded.get(n)
            for dest in [t] if leaf is None else [p for p, _ in _fill_pieces(leaf)]:
                check_destination(f"state entry {n!r}", dest)
            if leaf is None:
                req[n] = ("whole", tuple(t.shape), str(t.dtype).removeprefix("torch."))
            else:
                req[n] = ("shards", [(off, off + int(t.shape[0]), tuple(t.shape[1:]),
                                      str(t.dtype).removeprefix("torch."))
                                     for t, off in _fill_pieces(leaf)])
        box["req"] = req
        return req

    # Entries the step lacks are skipped with strict=False: ask first which it holds.
    held = None if strict else set(_table_names(ds, step))
    if held is not None:
        inner = make

        def make() -> dict:  # noqa: F811 - the strict=False filter over the request
            return {n: v for n, v in inner().items() if n in held}

    s, doc, tables, objects = _collective_read(ds, step, None, "load_state", make)
    err = None
    result = state

    def is_tensor(v: Any) -> bool:
        return isinstance(v, Shard) or (ds.shard_leaf is not None
                                        and ds.shard_leaf(v) is not None)

    lazy: dict[str, tuple[int, ...]] = {}
    try:
        flat, sharded = box["flat"], box["sharded"]
        if doc is not None:
            result = fill(state, doc, strict=strict, is_tensor=is_tensor)
            lazy = lazy_tables(state, doc, is_tensor=is_tensor)
        for n, (tm, ranges) in tables.items():
            leaf = sharded.get(n)
            if leaf is None:
                read_into(objects, tm, ds.pool, flat.tables[n].detach())
            elif isinstance(leaf, Shard):
                _fill(ds, objects, tm, ranges, leaf)
            else:
                from cnrstore.distributed.leaves import fill_leaf

                def rows(lo: int, hi: int, tm: Any = tm) -> torch.Tensor:
                    return read_table(objects, tm, ds.pool, rows=slice(lo, hi))[0]

                fill_leaf(leaf, rows)
    except BaseException as exc:
        err = exc
    _finish(ds, err, "load_state: read")
    # Empty containers the step holds filled (a fresh Adam's "state": {}, core/state.py)
    # get the stored entries as fresh tensors, read in one more collective round.
    if doc is not None and any(ds.comm.all_gather(bool(lazy), "load_state: adopt")):
        fresh = _read_whole(ds, s, sorted(lazy), "load_state: adopt")
        result = fill(state, doc, strict=strict, is_tensor=is_tensor,
                      adopt=lambda d: unflatten(d, stored_leaf(s, fresh)))
    return result


def _read_whole(ds: DistributedStore, step: int, names: list[str], what: str) -> dict:
    """Tables ``names`` of ``step``, whole, as fresh CPU tensors (collective: every rank
    enters, ``names`` may be empty on some)."""
    _, _, tables, objects = _collective_read(ds, step, None, what,
                                             lambda: {n: None for n in names})
    got: dict = {}
    err = None
    try:
        got = dict(zip(tables, read_tables(objects, ds.pool,
                                           [(tm, None) for tm, _ in tables.values()],
                                           torch.device("cpu"))))
    except BaseException as exc:
        err = exc
    _finish(ds, err, f"{what}: read")
    return got


def _fill_pieces(leaf: Any) -> list[tuple[torch.Tensor, int]]:
    """(local tensor, first global row) of every piece ``fill_leaf`` will fill: each
    replica too, where a put stores one."""
    if isinstance(leaf, Shard):
        return [(leaf.local, leaf.row_offset)]
    from cnrstore.distributed.leaves import _pieces

    return _pieces(leaf, for_fill=True) or []


def _table_names(ds: DistributedStore, step: Any) -> list[str]:
    s = ds.coordinated("load_state", lambda st: _names(st, step))
    return s


def _names(store: Any, step: Any) -> list[str]:
    objects = store.objects
    if step is None:
        steps = list_steps(objects)
        if not steps:
            raise StepNotFound(-1, "the store holds no steps")
        step = steps[-1]
    return list(load_step(objects, step)[1].tables)

"""Whole training states on a DistributedStore: put_state over the put pipeline
(core/put.py), get_state and load_state over the get pipeline (core/get.py, the ranks'
reader in read.py) (core/state.py splits a state into tables and a
structure; Shard, DTensor and ShardedTensor leaves are each rank's own rows). Every rank
returns, or every rank raises."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cnrstore.core.get import Located, get, out_bytes, read_rows
from cnrstore.core.progress import Reporter, check_progress
from cnrstore.core.put import RankStructure, put
from cnrstore.core.restore import read_table, read_tables
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
from cnrstore.core.stateselect import (
    KEEP_HOLE,
    NONE_HOLE,
    Selection,
    keep_to_none,
    leaf_names,
    prune,
    select,
)
from cnrstore.core.validate import check_destination, check_device
from cnrstore.distributed.boundary import fill_rows, row_kind
from cnrstore.distributed.leaves import global_shape, leaf_dtype, skeleton, uniform
from cnrstore.distributed.shard import Shard
from cnrstore.distributed.structure import Structure, agree
from cnrstore.errors import InvalidInput, StepNotFound
from cnrstore.format.load import list_steps, load_step

# The DistributedStore (cnrstore/distributed/store.py, which imports this module): typed
# loosely so the layers test sees no import cycle.
DistributedStore = Any

__all__ = ["get_state", "load_state", "put_state"]


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
            else:  # ShardedTensor's .shape / .dtype dispatch and warn (~1 ms a leaf)
                shape, dtype = global_shape(value), leaf_dtype(value)
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


def put_state(ds: DistributedStore, step: Any, state: Any, *, quant: Any, metadata: Any,
              blocking: bool, touched: Any, progress: Any = None) -> Any:
    # Column pieces become whole rows, and a tracker's touched rows with them
    # (cnrstore/distributed/columns.py; touched= may be TorchRec's ModelDeltaTracker):
    # what this rank holds of them rides the structure round.
    from cnrstore.distributed.columns import offer_state
    from cnrstore.distributed.put import Restructure

    offer = offer_state(ds, state, touched)
    kw = dict(quant=quant, metadata=metadata, blocking=blocking, progress=progress)
    skels = ds.last_skeletons
    if skels is not None:
        # The handle's last put_state agreed every rank's skeleton, and no rank held a
        # column piece: where this rank's state has that skeleton still and no column
        # piece, the structure round would give what it gave then, so the put goes
        # straight to its check round, which carries each rank's verdict; one changed
        # structure and every rank raises Restructure there and agrees it below.
        same, mine = False, state
        try:
            if (isinstance(state, Mapping) and offer.error is None and not offer.info
                    and skeleton(state) == skels[ds.rank]):
                mine, same = uniform(state, gather=lambda _mine: skels), True
        except Exception:  # noqa: BLE001 - found again by the structure round below
            same = False
        try:
            return _put_uniform(ds, step, mine, offer, [{}] * ds.comm.world, same, **kw)
        except Restructure:
            pass
    ds.last_skeletons = None
    agreed = agree(ds, state, "put_state: structure", offer.error, offer.info)
    if agreed.skels is not None and not any(agreed.extras):
        ds.last_skeletons = agreed.skels
    return _put_uniform(ds, step, agreed.state, offer, agreed.extras, None, **kw)


def _put_uniform(ds: DistributedStore, step: Any, state: Any, offer: Any, every: list,
                 cached: bool | None, *, quant: Any, metadata: Any, blocking: bool,
                 progress: Any) -> Any:
    """put_state of ``state`` as the structure round made it uniform (``cached``: as
    ``RankStructure.cached``; False: this rank's changed, so it only enters the check
    round, where every rank raises Restructure)."""
    if cached is False:
        return put(ds, step, {}, quant=quant, metadata=metadata, blocking=blocking,
                   touched=None, state=RankStructure(None, None, False), progress=progress)
    state, touched, done = offer.finish(every, state, "put_state: columns")
    err, doc, tables = None, None, {}
    try:  # local checks: a rank that fails here must still enter the put's rounds
        plain, sharded = _sharded(state, ds.shard_leaf)
        flat = flatten(plain)
        tables = dict(flat.tables)
        tables.update(sharded)
        doc = flat.doc
        if quant is None:
            quant = "exact"
        elif isinstance(quant, str) and quant != "exact":
            quant = {"*": quant}
    except BaseException as exc:
        err, tables = exc, {}
    # The structure stored names every rank's leaves, as DCP's metadata names every
    # rank's keys: a plain tensor or Python value only another rank gives (a table-wise
    # table) is stored, so it must be in the structure that get_state rebuilds. Every
    # rank's structure (or error) rides the put's check round (distributed/put.py).
    info = put(ds, step, tables, quant=quant, metadata=metadata, blocking=blocking,
               touched=touched, state=RankStructure(doc, err, cached), progress=progress)
    done()
    return info


def _select(ds: DistributedStore, step: Any, names: Any, what: str
            ) -> tuple[Any, Selection, Any, list[str]]:
    """(step, Selection of ``names``, stored structure, stored table names): the step
    resolved once (a later put cannot change what the names picked), the names checked
    against it on every rank (each rank may pick its own; every rank raises or returns)."""
    if names is None:
        return step, Selection(None), None, []
    s, doc, tables = ds.coordinated(what, lambda st: _structure(st, step))
    err, sel = None, Selection(None)
    try:
        sel = select(names, leaf_names(doc, tables), s)
    except BaseException as exc:
        err = exc
    ds.comm.agree(err, what, None)
    return s, sel, doc, tables


def get_state(ds: DistributedStore, step: Any, *, device: Any, names: Any = None,
              progress: Any = None) -> Any:
    step, sel, _, stored = _select(ds, step, names, "get_state: names")

    def make() -> Any:
        check_progress(progress)
        check_device(device)
        # Only the picked tables are asked for: the coordinator reads nothing else.
        return None if sel.everything else {n: None for n in stored if sel(n)}

    def read(loc: Located, report: Reporter) -> Any:
        done = report.add if report.fn is not None else None
        result = dict(zip(loc.tables, read_tables(loc.objects, ds.pool,
                                                  [(tm, None) for tm, _ in loc.tables.values()],
                                                  check_device(device), done=done)))
        if loc.doc is not None:
            check_structure(loc.doc)
            result = unflatten(prune(loc.doc, sel, NONE_HOLE), stored_leaf(loc.step, result))
        return result

    return get(ds, step, "get_state", make, read, progress=progress)


def load_state(ds: DistributedStore, step: Any, state: Any, *, strict: bool,
               names: Any = None, progress: Any = None,
               agreed: Structure | None = None) -> Any:
    """``agreed``: the structure round ``state`` came from already (the TorchRec load's,
    which carries the stored shapes too); otherwise load_state holds its own."""
    if agreed is None:
        agreed = agree(ds, state, "load_state: structure")
        state = agreed.state
    step, sel, stored_doc, stored = _select(ds, step, names, "load_state: names")
    box: dict[str, Any] = {}

    def make() -> dict:
        check_progress(progress)
        plain, sharded = _sharded(state, _load_leaf(ds))
        flat = flatten(plain)
        box["flat"], box["sharded"] = flat, sharded
        if strict and not sel.everything:  # fill checks only the entries it is given
            have = set(leaf_names(stored_doc, stored))
            extra = [n for n in leaf_names(flat.doc)
                     if sel(n) and n not in have and n not in flat.tables]
            if extra:
                raise InvalidInput(f"state entry {extra[0]!r} is not in the stored state")
        req: dict[str, Any] = {}
        for n, t in flat.tables.items():
            if not sel(n):
                continue
            leaf = sharded.get(n)
            for dest in [t] if leaf is None else [p for p, _ in _fill_pieces(leaf)]:
                check_destination(f"state entry {n!r}", dest)
            if leaf is None:
                req[n] = ("whole", tuple(t.shape), str(t.dtype).removeprefix("torch."))
            else:
                # whole rows of the table (a column piece takes its columns of them, and
                # reads them itself: only row pieces share blocks with other ranks')
                from cnrstore.distributed.leaves import is_column_leaf

                pieces = _fill_pieces(leaf)
                req[n] = ("shards" if is_column_leaf(leaf) else
                          row_kind([p for p, _ in pieces]),
                          [(off, off + int(p.shape[0]), tuple(t.shape[1:]),
                            str(p.dtype).removeprefix("torch.")) for p, off in pieces])
        box["req"] = req
        return req

    # Entries the step lacks are skipped with strict=False: ask first which it holds.
    held = None if strict else set(stored) if names is not None else set(
        _table_names(ds, step))
    if held is not None:
        inner = make

        def make() -> dict:  # noqa: F811 - the strict=False filter over the request
            return {n: v for n, v in inner().items() if n in held}

    def is_tensor(v: Any) -> bool:
        return isinstance(v, Shard) or _load_leaf(ds)(v) is not None

    def read(loc: Located, report: Reporter) -> tuple[int, Any, Any, dict, Reporter]:
        # This rank's in-place restore, as CheckpointStore.load_state reports it (the
        # tables adopted into empty containers below are read without a report, there as
        # here).
        result, doc, lazy = state, loc.doc, {}
        objects, tables = loc.objects, loc.tables
        flat, sharded = box["flat"], box["sharded"]
        if doc is not None:
            doc = prune(doc, sel, KEEP_HOLE)
            result = fill(state, doc, strict=strict and sel.everything, is_tensor=is_tensor)
            lazy = lazy_tables(state, doc, is_tensor=is_tensor)
        # Each local piece of a sharded leaf is decoded in place where it can be: a read
        # into fresh memory and a copy cost a cold restore its page faults twice. The
        # pieces were checked against the stored table by the request. The pieces of
        # rows (TorchRec's tables and optimizer states) in one pass, in windows, each file
        # forwards (core/windowread.py), as the DCP reader reads them, a block they share
        # with another rank's read by one of the two (boundary.py); filled one table at a
        # time, every block was located alone and hinted with POSIX_FADV_WILLNEED: the
        # request pattern docs/design/torchrec-speed.md found behind the cold TorchRec
        # restore's gap to dcp.load.
        from cnrstore.distributed.leaves import fill_leaf, is_column_leaf

        rows: list[tuple[str, int, Any]] = []
        columns: list[tuple[Any, Any]] = []
        for n, (tm, _) in tables.items():
            leaf = sharded.get(n)
            if leaf is None:  # a plain tensor: the whole table (each rank its own)
                rows.append((n, 0, flat.tables[n].detach()))
            elif isinstance(leaf, Shard):
                rows.append((n, 0, leaf))
            elif is_column_leaf(leaf):
                # A column piece is narrower than the stored rows: it takes its columns
                # of whole rows, read once per row range for all of its pieces.
                columns.append((tm, leaf))
            else:
                rows += [(n, k, Shard(piece, row_offset=off, rows=tm.node.rows))
                         for k, (piece, off) in enumerate(_fill_pieces(leaf))]
        fill_rows(ds, loc, rows, done=report.add if report.fn else None)
        for tm, leaf in columns:
            def whole_rows(lo: int, hi: int, tm: Any = tm) -> torch.Tensor:
                report.add(out_bytes(tm, slice(lo, hi)))
                return read_table(objects, tm, ds.pool, rows=slice(lo, hi))[0]

            fill_leaf(leaf, whole_rows)
        return loc.step, result, doc, lazy, report

    s, result, doc, lazy, report = get(ds, step, "load_state", make, read, progress=progress,
                                       finish=False)
    # Empty containers the step holds filled (a fresh Adam's "state": {}, core/state.py)
    # get the stored entries as fresh tensors, read in one more collective round. Only
    # what is empty on every rank: a rank whose dict lacks a table another rank holds
    # (table-wise, given as a plain tensor there) must not read the whole table.
    # Where the structure round showed no empty container on any rank, no rank has one
    # to adopt into: every rank knows it, and none holds the round.
    if doc is not None and not agreed.no_empty:
        every = ds.comm.all_gather(sorted(lazy), "load_state: adopt")
        adopted = set(every[0]).intersection(*every[1:])
        if adopted:
            fresh = _read_whole(ds, s, sorted(adopted), "load_state: adopt")

            def adopt(d: dict) -> Any:
                d = keep_to_none(d)
                if not set(check_structure(d)) <= adopted:
                    return None
                return unflatten(d, stored_leaf(s, fresh))

            result = fill(state, doc, strict=strict and sel.everything, is_tensor=is_tensor,
                          adopt=adopt)
    report.finish()
    return result


def _read_whole(ds: DistributedStore, step: int, names: list[str], what: str) -> dict:
    """Tables ``names`` of ``step``, whole, as fresh CPU tensors (collective: every rank
    enters, ``names`` may be empty on some)."""
    return get(ds, step, what, lambda: {n: None for n in names}, read_rows(ds, "cpu", None))


def _fill_pieces(leaf: Any) -> list[tuple[torch.Tensor, int]]:
    """(local tensor, first global row) of every piece ``fill_leaf`` will fill: each
    replica too, where a put stores one."""
    if isinstance(leaf, Shard):
        return [(leaf.local, leaf.row_offset)]
    from cnrstore.distributed.leaves import _pieces

    return _pieces(leaf, for_fill=True) or []


def _load_leaf(ds: DistributedStore) -> Any:
    """``ds.shard_leaf`` for a load: a column-sharded leaf is a sharded leaf too (fill_leaf
    reads whole rows for it), where a put joins it first (columns.py)."""
    if ds.shard_leaf is None:
        return None
    from cnrstore.distributed.leaves import is_column_leaf

    def leaf(v: Any) -> Any:
        if not isinstance(v, (Shard, Mapping, list, tuple, str, bytes)) and is_column_leaf(v):
            return []
        return ds.shard_leaf(v)

    return leaf


def _table_names(ds: DistributedStore, step: Any) -> list[str]:
    return ds.coordinated("load_state", lambda st: _structure(st, step))[2]


def _structure(store: Any, step: Any) -> tuple[int, Any, list[str]]:
    """(step, stored structure or None, table names) of ``step`` (None: the highest)."""
    objects = store.objects
    if step is None:
        steps = list_steps(objects)
        if not steps:
            raise StepNotFound(-1, "the store holds no steps")
        step = steps[-1]
    node = load_step(objects, step)[1]
    return step, node.state, list(node.tables)

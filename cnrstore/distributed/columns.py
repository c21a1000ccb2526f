"""Column pieces joined into whole rows before a put (docs/TORCHREC.md, "Sharding types").

Column-wise, table-column-wise and grid shardings give a rank part of the columns of a
range of rows. The store's unit is the whole row, and a table's stored blocks must not
depend on the plan (docs/ARCHITECTURE.md, "On-disk rules"), so a put first moves the pieces:
rank r of W receives whole rows [r * n // W, (r + 1) * n // W) of an n-row table, every
piece holder sends it the columns it holds of those rows (one ``all_to_all`` of bytes
for all the tables of a put), and the put then sees an ordinary row-sharded table,
which it stores exactly as a row-wise plan of the same values.

A join is collective on a DistributedStore: one all-gather of what each rank holds
(and of its touched rows; put_state carries it on its structure round, ``offer_state``,
a DCP save takes a round of its own, ``join_pieces``), one exchange of the rows. Every rank returns,
or every rank raises the same error (a plan whose pieces do not tile a table names it);
``Joined.shards()`` then assembles this rank's rows locally.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from cnrstore.codec.layout import dtype_name, parse_dtype
from cnrstore.core.state import MAX_DEPTH, SEP
from cnrstore.distributed.leaves import Piece, is_column_leaf, pieces
from cnrstore.distributed.shard import Shard
from cnrstore.errors import InvalidInput

__all__ = ["join_pieces", "offer_state", "Joined", "Offer", "StateOffer", "column_leaves",
           "target_rows", "whole"]


def target_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The whole rows [lo, hi) of a joined table rank ``rank`` puts: an even split, so the
    rows a put writes per rank do not depend on the plan's pieces."""
    return rows * rank // world, rows * (rank + 1) // world


def column_leaves(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``leaves`` (name -> leaf) that are sharded by columns."""
    out = {}
    for n, v in leaves.items():
        try:
            if not isinstance(v, Shard) and is_column_leaf(v):
                out[n] = v
        except InvalidInput as exc:
            raise InvalidInput(f"table {n!r}: {exc}") from exc
    return out


def _describe(name: str, leaf: Any) -> tuple[tuple[int, ...], str, list[Piece]]:
    try:
        got = pieces(leaf) or []
    except InvalidInput as exc:
        raise InvalidInput(f"table {name!r}: {exc}") from exc
    gshape = tuple(int(d) for d in leaf.shape)
    dtype: Any = getattr(leaf, "dtype", None)
    md = getattr(leaf, "metadata", None)
    if callable(md) and not hasattr(leaf, "placements"):  # ShardedTensor: no deprecation
        dtype = md().tensor_properties.dtype
    if len(gshape) != 2:
        raise InvalidInput(f"table {name!r}: a column-sharded tensor of shape {gshape}; only "
                           "2-D tables are joined from column pieces")
    return gshape, dtype_name(dtype), [(t.detach(), r, c) for t, r, c in got if t.numel()]


def _tiles(name: str, rows: int, cols: int, held: list[tuple[int, int, int, int, int]],
           plan: str) -> None:
    """Every (row, column) of the table in exactly one piece, else an error naming the
    table and the plan's pieces (the same on every rank: all see the same list)."""
    bounds = sorted({0, rows, *[r for _, r, _, _, _ in held], *[r + n for _, r, n, _, _ in held]})
    for lo, hi in zip(bounds, bounds[1:]):
        cover = sorted((c, c + w) for _, r, n, c, w in held if r <= lo and hi <= r + n)
        pos = 0
        for c, e in cover:
            if c != pos:
                break
            pos = e
        if pos != cols or len(cover) != len({c for c, _ in cover}) or (
                cover and cover[-1][1] != cols):
            raise InvalidInput(
                f"table {name!r}: the column pieces of rows {lo}..{hi} do not tile its "
                f"{cols} columns once ({plan}); every column of a row must be in exactly one "
                "piece of one rank")


def _plan_text(held: list[tuple[int, int, int, int, int]]) -> str:
    return "pieces " + ", ".join(f"rank {k}: rows {r}..{r + n} cols {c}..{c + w}"
                                 for k, r, n, c, w in held[:12]) + (
        f", ... ({len(held)} in all)" if len(held) > 12 else "")


class Joined:
    """What every rank sent and got in a join; ``shards()`` assembles this rank's rows."""

    def __init__(self, rank: int, world: int, specs: dict[str, tuple], got: list[torch.Tensor],
                 touched: Any):
        self.rank, self.world = rank, world
        self.specs, self.got, self.touched = specs, got, touched

    def shards(self) -> dict[str, Shard]:
        """name -> this rank's whole rows of each joined table (zero rows where the even
        split gives it none)."""
        out: dict[str, Shard] = {}
        bufs = dict(enumerate(self.got))
        pos = [0] * self.world
        for name, (rows, cols, dtype, held) in self.specs.items():
            lo, hi = target_rows(rows, self.world, self.rank)
            t = torch.empty((hi - lo, cols), dtype=parse_dtype(dtype))
            for src, r, n, c, w in held:
                a, b = max(lo, r), min(hi, r + n)
                if a >= b:
                    continue
                nbytes = (b - a) * w * t.element_size()
                raw = bufs[src][pos[src]:pos[src] + nbytes]
                pos[src] += nbytes
                # a copy: the piece may start at any byte of the buffer (the tables
                # before it of another dtype), where a view of another dtype cannot
                t[a - lo:b - lo, c:c + w] = raw.clone().view(t.dtype).view(b - a, w)
            out[name] = Shard(t, row_offset=lo, rows=rows)
        if any(p != len(bufs[s]) for s, p in enumerate(pos)):
            raise InvalidInput("column join: the bytes received do not match the agreed "
                               "pieces (a bug: report it)")
        return out


def _send_buffer(mine: Mapping[str, tuple], world: int) -> tuple[torch.Tensor, list[int]]:
    """The bytes this rank sends, per destination rank in rank order: for each joined
    table (agreed order) and each of this rank's pieces (listed order), the rows of the
    destination's range, contiguous."""
    per: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for _name, (gshape, _dtype, pcs) in mine.items():
        rows = gshape[0]
        for d in range(world):
            lo, hi = target_rows(rows, world, d)
            for t, r, _c in pcs:
                a, b = max(lo, r), min(hi, r + int(t.shape[0]))
                if a < b:
                    per[d].append(t[a - r:b - r].cpu().contiguous().reshape(-1).view(torch.uint8))
    sizes = [sum(int(x.numel()) for x in p) for p in per]
    flat = [x for p in per for x in p]
    buf = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    return buf, sizes


def _offer(ds: Any, leaves: Mapping[str, Any], touched: Mapping | None,
           error: BaseException | None) -> Offer:
    """The offer of the column-sharded entries of ``leaves`` (name -> leaf, every rank the
    same names after ``leaves.uniform``, or only the names it holds). ``touched`` (name ->
    GLOBAL row ids of this rank's pieces) is joined too: each rank gets the union over the
    piece holders of the rows in its range; a table some holder gave no touched rows for
    is left out (its rows are found by fingerprints)."""
    mine: dict[str, tuple] = {}
    try:
        if error is not None:
            raise error
        for name, leaf in column_leaves(leaves).items():
            mine[name] = _describe(name, leaf)
    except BaseException as exc:
        error = exc
    return Offer(ds, mine, touched, error)


def join_pieces(ds: Any, mine: Mapping[str, tuple], touched: Mapping | None, what: str, *,
                error: BaseException | None = None) -> Joined:
    """A join, in a round of its own, of pieces already named: name -> (global shape,
    dtype name, [(local, row offset, column offset)]) of this rank (a DCP save's chunks)."""
    offer = Offer(ds, mine, touched, error)
    return offer.joined(ds.comm.agree(offer.error, what, offer.info), what)


class Offer:
    """This rank's side of a join before its round: what it holds (``info``, the payload
    every rank all-gathers; ``error``, what it enters the round with) and the bytes it
    sends. The round may be another's that carries ``info`` along (put_state's structure
    round): ``joined(every)`` takes every rank's ``info``."""

    def __init__(self, ds: Any, mine: Mapping[str, tuple], touched: Mapping | None,
                 error: BaseException | None = None):
        self.ds, self.mine, self.touched = ds, mine, touched
        self.error: BaseException | None = error
        self.info: dict[str, tuple] = {}
        self.buf, self.sizes = torch.empty(0, dtype=torch.uint8), [0] * ds.comm.world
        try:
            if error is not None:
                raise error
            tmap = dict(touched) if isinstance(touched, Mapping) else None
            for name, (gshape, dtype, pcs) in mine.items():
                ids = None
                if tmap is not None and name in tmap:
                    ids = torch.as_tensor(tmap[name]).flatten().to(torch.int64).tolist()
                self.info[name] = (gshape[0], gshape[1], dtype,
                                   [(r, int(t.shape[0]), c, int(t.shape[1]))
                                    for t, r, c in pcs], ids)
            self.buf, self.sizes = _send_buffer(mine, ds.comm.world)
        except BaseException as exc:
            self.error = exc

    def joined(self, every: list[dict], what: str) -> Joined:
        """The join, given every rank's ``info`` (the round raised any rank's error)."""
        ds, mine, touched = self.ds, self.mine, self.touched
        buf, sizes = self.buf, self.sizes
        specs: dict[str, tuple] = {}
        joined_touched: dict[str, list] = {}
        for src, tables in enumerate(every):
            for name, (rows, cols, dtype, held, ids) in tables.items():
                spec = specs.setdefault(name, (rows, cols, dtype, []))
                if (spec[0], spec[1], spec[2]) != (rows, cols, dtype):
                    raise InvalidInput(f"table {name!r}: ranks disagree on its shape or "
                                       f"dtype ({spec[:3]} and {(rows, cols, dtype)})")
                spec[3].extend((src, r, n, c, w) for r, n, c, w in held)
                if held:
                    if ids is None:
                        joined_touched[name] = None  # type: ignore[assignment]
                    elif joined_touched.get(name, []) is not None:
                        joined_touched.setdefault(name, []).extend(ids)
        for name, (rows, cols, _dt, held) in specs.items():
            _tiles(name, rows, cols, held, _plan_text(held))
        # what this rank expects from each: the same walk as the sender's, seen from here
        expect = [0] * ds.comm.world
        lo_hi = {n: target_rows(s[0], ds.comm.world, ds.comm.rank) for n, s in specs.items()}
        for name, (_rows, _cols, dtype, held) in specs.items():
            lo, hi = lo_hi[name]
            size = torch.empty(0, dtype=parse_dtype(dtype)).element_size()
            for src, r, n, _c, w in held:
                a, b = max(lo, r), min(hi, r + n)
                if a < b:
                    expect[src] += (b - a) * w * size
        # the sender walks its own tables in its order; the receiver in the agreed order:
        # both must be the agreed order
        order = list(specs)
        if list(mine) != [n for n in order if n in mine]:
            buf, sizes = _send_buffer({n: mine[n] for n in order if n in mine}, ds.comm.world)
        got = [torch.empty(0, dtype=torch.uint8)] * ds.comm.world
        if specs:  # every rank sees the same specs: all skip the round, or none
            got = ds.comm.exchange(buf, sizes, expect, f"{what}: rows")
        out_touched: Any = touched
        if isinstance(touched, Mapping):
            out_touched = {k: v for k, v in touched.items() if k not in specs}
            for name, ids in joined_touched.items():
                if ids is None:
                    continue
                lo, hi = lo_hi[name]
                t = torch.unique(torch.tensor(ids, dtype=torch.int64))
                out_touched[name] = t[(t >= lo) & (t < hi)]
        return Joined(ds.comm.rank, ds.comm.world, specs, got, out_touched)


def whole(name: str, rows: int, cols: int, pcs: list[Piece]) -> torch.Tensor:
    """One process holds every piece of a table: the table, assembled (checked)."""
    held = [(0, r, int(t.shape[0]), c, int(t.shape[1])) for t, r, c in pcs if t.numel()]
    _tiles(name, rows, cols, held, _plan_text(held))
    out = torch.empty((rows, cols), dtype=pcs[0][0].dtype)
    for t, r, c in pcs:
        out[r:r + t.shape[0], c:c + t.shape[1]] = t
    return out


# -- a whole state -----------------------------------------------------------------------

def _walk(value: Any, path: str, out: dict, depth: int = 0) -> None:
    """path -> leaf, paths as core/state.py names the tables (SEP between keys)."""
    if depth > MAX_DEPTH:
        return  # the put's own walk reports it
    if isinstance(value, Mapping):
        for k, v in value.items():
            _walk(v, f"{path}{SEP}{k}" if path else str(k), out, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(v, f"{path}{SEP}{i}" if path else str(i), out, depth + 1)
    elif not isinstance(value, (str, bytes)):
        out[path] = value


def _replace(value: Any, path: str, new: Mapping[str, Any], depth: int = 0) -> Any:
    if path in new:
        return new[path]
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        return {k: _replace(v, f"{path}{SEP}{k}" if path else str(k), new, depth + 1)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_replace(v, f"{path}{SEP}{i}" if path else str(i), new, depth + 1)
                 for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


class StateOffer:
    """put_state's side of the column join before its round (``offer_state``): ``error``
    and ``info`` ride the structure round; ``finish`` does the rest."""

    def __init__(self, offer: Offer, done: Callable[[], None]):
        self.offer, self.done = offer, done
        self.error, self.info = offer.error, offer.info

    def finish(self, every: list[dict], state: Any, what: str) -> tuple[Any, Any, Any]:
        """(state with its column-sharded leaves as Shards of whole rows, touched as the
        put takes it, the callable to run once the put returned), given every rank's
        ``info``; ``state`` is the one the round made uniform."""
        joined = self.offer.joined(every, what)
        if not joined.specs:
            return state, joined.touched, self.done
        err, shards = None, {}
        try:
            shards = joined.shards()
        except BaseException as exc:
            err = exc
        self.offer.ds.comm.agree(err, f"{what}: assemble", None)
        return _replace(state, "", shards), joined.touched, self.done


def offer_state(ds: Any, state: Any, touched: Any) -> StateOffer:
    """This rank's column pieces of ``state``, offered for a join whose round another
    carries; never raises (the error rides the round). A tracker in ``touched`` is read
    here, against the pieces as TorchRec gave them."""
    from cnrstore.distributed.torchrec import resolve_touched

    err: BaseException | None = None
    leaves: dict[str, Any] = {}

    def done() -> None:
        return None

    try:
        touched, done = resolve_touched(touched, state)
        _walk(state, "", leaves)
    except BaseException as exc:
        err = exc
    return StateOffer(_offer(ds, leaves, touched, err), done)

"""Sharded state leaves (ShardedTensor, DTensor) as the store's unit: rows of a table.

``shard_leaf(x)`` names the rows THIS rank holds of a sharded leaf as ``cnrstore.Shard``s on
the table's global row grid; ``fill_leaf(x, read)`` writes a restored table's rows into the
leaf's local shards, in place. The distributed put_state/load_state call both for every
tensor leaf of a state (docs/GUIDE.md, "Many ranks and object stores").

Where the rows of a rank are recorded:
- ShardedTensor: ``local_shards()``, each with ``metadata.shard_offsets``/``shard_sizes``.
- DTensor built by TorchRec (its local tensor is a ``LocalShardsWrapper``): the wrapper's
  ``local_shards()`` and ``local_offsets()``. TorchRec's placements do NOT describe this
  layout (a table-wise table says Replicate, a table-row-wise one Shard(1)), so they are
  ignored whenever the local tensor carries its own offsets.
- Any other DTensor: its placements over its mesh. Along a Replicate mesh dimension only the
  coordinate-0 rank contributes rows, so a replicated table is stored once; every replica is
  filled on restore.

A rank that holds no row of the table still gets one zero-row Shard: the table's name, row
count, dtype and trailing shape are then known on every rank. A piece that does not span all
columns (column-wise, table-column-wise, grid) is a column piece (``pieces``): the store's
unit is the whole row, so a put first joins the column pieces of every rank into whole rows
(cnrstore/distributed/columns.py) and ``shard_leaf`` refuses them; ``fill_leaf`` reads
whole rows and takes each piece's columns.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cnrstore.core.state import MAX_DEPTH, SEP
from cnrstore.distributed.shard import Shard
from cnrstore.errors import InvalidInput, InvalidType

__all__ = ["shard_leaf", "fill_leaf", "is_sharded_leaf", "is_column_leaf", "pieces",
           "row_spans", "skeleton", "uniform"]


def _types() -> tuple[Any, Any]:
    """(ShardedTensor, DTensor) classes, None where this torch build lacks them."""
    if not torch.distributed.is_available():  # pragma: no cover - builds without distributed
        return None, None
    st: Any = None
    dt: Any = None
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        st = ShardedTensor
    except ImportError:  # pragma: no cover - removed in some future torch
        pass
    try:
        from torch.distributed.tensor import DTensor

        dt = DTensor
    except ImportError:  # pragma: no cover - torch < 2.4 has it under _tensor
        try:
            from torch.distributed import _tensor

            dt = _tensor.DTensor
        except ImportError:
            pass
    return st, dt


def is_sharded_leaf(x) -> bool:
    st, dt = _types()
    return (st is not None and isinstance(x, st)) or (dt is not None and isinstance(x, dt))


def _check_piece(what: str, offsets, sizes, gshape) -> int:
    """The column offset of a piece of the global tensor: whole rows (0), or a column
    piece (column-wise, table-column-wise, grid: cut along dim 1 only, joined into whole
    rows before a put, cnrstore/distributed/columns.py)."""
    if len(offsets) != len(gshape) or len(sizes) != len(gshape):
        raise InvalidInput(f"{what}: a shard of rank {len(sizes)} in a tensor of shape "
                           f"{tuple(gshape)}")
    if any(int(o) != 0 for o in offsets[2:]) or tuple(int(s) for s in sizes[2:]) != tuple(
            int(g) for g in gshape[2:]):
        raise InvalidInput(
            f"{what} is cut along a dim past the columns (a shard at offset "
            f"{tuple(int(o) for o in offsets)} of size {tuple(int(s) for s in sizes)} in a "
            f"{tuple(int(g) for g in gshape)} tensor); cnrstore joins row and column pieces "
            "only")
    return int(offsets[1]) if len(gshape) > 1 else 0


def _partial(width: int, col: int, gshape) -> bool:
    return len(gshape) > 1 and (col != 0 or width != int(gshape[1]))


Piece = tuple[torch.Tensor, int, int]  # (local tensor, global row offset, column offset)


def _pieces(x, *, for_fill: bool) -> list[tuple[torch.Tensor, int]] | None:
    """(local tensor, global row offset) of each piece of ``x`` on this rank, or None when
    ``x`` is not sharded. ``for_fill``: every replica counts (all must be restored);
    otherwise only one replica of a replicated piece does (it is stored once)."""
    got = pieces(x, for_fill=for_fill)
    return None if got is None else [(t, r) for t, r, _ in got]


def pieces(x, *, for_fill: bool = False) -> list[Piece] | None:
    """(local tensor, global row offset, column offset) of each piece of ``x`` on this
    rank (column pieces included), or None when ``x`` is not sharded."""
    if isinstance(x, Shard):  # already named (a placeholder of a rank that holds no row)
        return [(x.local, x.row_offset, 0)]
    st_cls, dt_cls = _types()
    if st_cls is not None and isinstance(x, st_cls):
        gshape = global_shape(x)
        for md in x.metadata().shards_metadata:  # every shard: each rank judges alike
            _check_piece("ShardedTensor", md.shard_offsets, md.shard_sizes, gshape)
        out = []
        for s in x.local_shards():
            md = s.metadata
            col = _check_piece("ShardedTensor", md.shard_offsets, md.shard_sizes, gshape)
            if tuple(s.tensor.shape) != tuple(md.shard_sizes):
                raise InvalidInput(f"ShardedTensor: a local shard of shape "
                                   f"{tuple(s.tensor.shape)}, its metadata says "
                                   f"{tuple(md.shard_sizes)}")
            out.append((s.tensor, int(md.shard_offsets[0]), col))
        return out
    if dt_cls is not None and isinstance(x, dt_cls):
        gshape = tuple(x.shape)
        local = x._local_tensor  # to_local() is an autograd op; the storage is what we need
        if hasattr(local, "local_shards") and hasattr(local, "local_offsets"):
            # TorchRec's LocalShardsWrapper (torchrec's copy or torch's own)
            out = []
            for t, off in zip(local.local_shards(), local.local_offsets()):
                col = _check_piece("DTensor", tuple(off), tuple(t.shape), gshape)
                out.append((t, int(off[0]), col))
            return out
        return _placed_piece(x, local, gshape, for_fill=for_fill)
    return None


def is_column_leaf(x) -> bool:
    """Whether this rank's pieces of ``x`` (or, for a ShardedTensor, any rank's) are
    column pieces: part of every row they hold."""
    st_cls, _ = _types()
    if st_cls is not None and isinstance(x, st_cls):
        gshape = global_shape(x)
        return len(gshape) > 1 and any(
            _partial(int(md.shard_sizes[1]), int(md.shard_offsets[1]), gshape)
            for md in x.metadata().shards_metadata)
    got = pieces(x) if is_sharded_leaf(x) else None
    if not got:
        return False
    gshape = global_shape(x)
    return len(gshape) > 1 and any(_partial(int(t.shape[1]), c, gshape) for t, _, c in got)


def _placed_piece(x, local: torch.Tensor, gshape, *, for_fill: bool):
    from torch.distributed.tensor import Replicate  # noqa: N811
    from torch.distributed.tensor import Shard as PShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = x.device_mesh, x.placements
    coords = mesh.get_coordinate()
    if coords is None:  # this rank is not in the mesh
        return []
    for dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            if not for_fill and coords[dim] != 0:
                return []
        elif not isinstance(p, PShard):
            raise InvalidInput(f"DTensor with placement {type(p).__name__} {p} (mesh dimension "
                               f"{dim}): only Shard and Replicate placements hold plain rows")
    shape, offset = compute_local_shape_and_global_offset(gshape, mesh, placements)
    col = _check_piece("DTensor", tuple(offset), tuple(shape), gshape)
    if tuple(local.shape) != tuple(shape):
        raise InvalidInput(f"DTensor: local tensor of shape {tuple(local.shape)}, its "
                           f"placements give {tuple(shape)}")
    return [(local, int(offset[0]), col)]


def row_spans(x) -> list[tuple[int, int]]:
    """The distinct (first row, row count) of this rank's pieces of ``x``, in row order:
    where TorchRec's shard-local row ids count (the column pieces of one row range share
    their row ids)."""
    got = pieces(x) or []
    return sorted({(r, int(t.shape[0])) for t, r, _ in got if t.shape[0]})


def leaf_dtype(x) -> torch.dtype:
    md = getattr(x, "metadata", None)  # ShardedTensor.dtype warns that it is deprecated
    if callable(md) and not hasattr(x, "placements"):
        return md().tensor_properties.dtype
    return x.dtype


def global_shape(x) -> tuple[int, ...]:
    if isinstance(x, Shard):
        return (x.rows, *map(int, x.local.shape[1:]))
    md = getattr(x, "metadata", None)  # ShardedTensor.size() warns that it is deprecated
    if callable(md) and not hasattr(x, "placements"):
        return tuple(int(d) for d in md().size)
    return tuple(int(d) for d in x.shape)


def shard_leaf(x) -> list[Shard] | None:
    """This rank's rows of ``x`` as Shards (sorted by row offset), or None when ``x`` is not
    a ShardedTensor, DTensor or Shard. Raises InvalidInput for a column-wise layout or a scalar."""
    if isinstance(x, Shard):
        return [x]
    got = pieces(x, for_fill=False)
    if got is None:
        return None
    gshape = global_shape(x)
    if len(gshape) == 0:
        raise InvalidInput("a sharded tensor of ndim 0 has no rows")
    if is_column_leaf(x):
        held = ", ".join(f"rows {r}..{r + t.shape[0]} cols {c}..{c + t.shape[1]}"
                         for t, r, c in got[:8]) or "none"
        raise InvalidInput(
            f"a {type(x).__name__} of shape {tuple(gshape)} is sharded by columns (this "
            f"rank's pieces: {held}); put_state and the DCP writer join column pieces into "
            "whole rows (cnrstore/distributed/columns.py), put_tables does not: put it "
            "with put_state")
    rows = gshape[0]
    shards = sorted((Shard(t.detach(), row_offset=off, rows=rows)
                     for t, off, _ in got if t.shape[0] > 0), key=lambda s: s.row_offset)
    if not shards:  # name the table on every rank, with its dtype and trailing shape
        empty = torch.empty((0, *gshape[1:]), dtype=leaf_dtype(x))
        shards = [Shard(empty, row_offset=0, rows=rows)]
    return shards


def fill_leaf(x, read: Callable[[int, int], torch.Tensor]) -> None:
    """Fill ``x``'s local rows in place: each local piece holding global rows [lo, hi) gets
    ``read(lo, hi)`` (whole rows; a column piece takes its columns of them, and the
    column pieces of one row range read it once). A plain tensor is filled whole (rows
    [0, len)). Shapes are checked for every piece before anything is written."""
    got = pieces(x, for_fill=True)
    if got is None:
        if not isinstance(x, torch.Tensor):
            raise InvalidType(f"fill_leaf: a tensor is needed, got {type(x).__name__}")
        got = [(x, 0, 0)] if x.ndim > 0 else [(x.reshape(1), 0, 0)]
        gshape: tuple = tuple(got[0][0].shape)
    else:
        gshape = global_shape(x)
    todo = [(t, off, col) for t, off, col in got if t.shape[0] > 0]
    data = []
    cache: dict[tuple[int, int], torch.Tensor] = {}
    for t, off, col in todo:
        span = (off, off + int(t.shape[0]))
        rows = cache.get(span)
        if rows is None:
            rows = cache[span] = read(*span)
        if not isinstance(rows, torch.Tensor):
            raise InvalidType(f"fill_leaf: read returned a {type(rows).__name__}")
        if len(gshape) > 1 and _partial(int(t.shape[1]), col, gshape):
            if rows.ndim < 2 or rows.shape[1] < col + t.shape[1]:
                raise InvalidInput(f"fill_leaf: rows {off}..{off + t.shape[0]} read as "
                                   f"{tuple(rows.shape)}, too narrow for the columns "
                                   f"{col}..{col + t.shape[1]} of the local shard; nothing "
                                   "was written")
            rows = rows[:, col:col + t.shape[1]]
        if tuple(rows.shape) != tuple(t.shape):
            if rows.numel() != t.numel() or rows.shape[0] != t.shape[0]:
                raise InvalidInput(f"fill_leaf: rows {off}..{off + t.shape[0]} read as "
                                   f"{tuple(rows.shape)}, the local shard is "
                                   f"{tuple(t.shape)}; nothing was written")
            rows = rows.reshape(t.shape)  # a [rows, 1] state read into a 1-D shard, or back
        data.append(rows)
    with torch.no_grad():
        for (t, _, _), rows in zip(todo, data):
            t.copy_(rows)


# -- one structure on every rank ---------------------------------------------------------

def _describe(value) -> tuple:
    if isinstance(value, Shard):
        return ("S", (value.rows, *map(int, value.local.shape[1:])), str(value.local.dtype))
    if is_sharded_leaf(value):
        return ("S", global_shape(value), str(leaf_dtype(value)))
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype))
    return ("P",)


def skeleton(value, path: tuple = ()) -> list:
    """What ``uniform`` all-gathers of a state: [(path, kind), ...] of every dict ("D")
    and leaf in order (a caller may carry it on a round of its own)."""
    if len(path) > MAX_DEPTH:  # before Python's own recursion limit (a RecursionError)
        raise InvalidInput(f"state nests deeper than {MAX_DEPTH} at "
                           f"{SEP.join(map(str, path[:8]))!r}... (a cycle?)")
    if isinstance(value, Mapping):
        out: list = [(path, ("D",))]
        for k, v in value.items():
            out += skeleton(v, (*path, k))
        return out
    return [(path, _describe(value))]


def uniform(state, group=None, *, gather: Callable[[Any], list] | None = None):
    """``state`` with the same nesting on every rank of ``group`` (collective; ``gather``
    replaces the all-gather): dict entries any rank has are present on all, in the order
    of the lowest rank that has them; a sharded leaf a rank lacks becomes a zero-row Shard
    of its table. TorchRec's fused optimizer state needs this: it names a table only on the
    ranks that hold its rows, in an order that differs between ranks. A plain tensor or
    Python value that some ranks lack cannot be made up and stays absent there."""
    import torch.distributed as dist

    if not isinstance(state, Mapping):
        return state
    mine = skeleton(state)
    if gather is not None:
        every = gather(mine)
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
    else:
        every = [mine]
    kinds: dict[tuple, tuple] = {}
    children: dict[tuple, list] = {}
    for skel in every:
        for path, kind in skel:
            if path not in kinds:
                kinds[path] = kind
                if path:
                    children.setdefault(path[:-1], []).append(path[-1])
                continue
            seen = kinds[path]
            if seen != kind and "S" == seen[0] == kind[0]:
                name = "/".join(map(str, path))
                raise InvalidInput(f"state entry {name!r}: ranks disagree on its table: "
                                   f"{seen[1:]} vs {kind[1:]}")
    return _rebuild(state, (), kinds, children)


def _rebuild(value, path: tuple, kinds: dict, children: dict) -> Any:
    if not isinstance(value, Mapping):
        return value
    out: dict = {}
    for key in children.get(path, ()):
        p = (*path, key)
        kind = kinds[p]
        if key in value:
            out[key] = _rebuild(value[key], p, kinds, children)
        elif kind[0] == "S":
            _, shape, dtype = kind
            out[key] = Shard(torch.empty((0, *shape[1:]), dtype=getattr(torch, dtype[6:])),
                             row_offset=0, rows=shape[0])
        elif kind[0] == "D":
            out[key] = _rebuild({}, p, kinds, children)
    if type(value) is not dict:  # keep an OrderedDict a state_dict came as (its _metadata)
        try:
            kept: Any = copy.copy(value)
            kept.clear()
            kept.update(out)
            return kept
        except (TypeError, AttributeError):
            pass
    return out

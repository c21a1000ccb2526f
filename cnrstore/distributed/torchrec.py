"""TorchRec: checkpoint a DistributedModelParallel model and its fused optimizer, restore it
under another plan, world size, or into a plain unsharded model (docs/TORCHREC.md).

    state = cnrstore.distributed.torchrec.state_dict(dmp)         # {"model": ..., "optim": ...}
    store.put_state(step, state, touched=tracker)          # tracker: optional, see touched_rows
    cnrstore.distributed.torchrec.load(store, step, dmp)          # in place, any plan / world size
    cnrstore.distributed.torchrec.load_unsharded(store, step, ebc)  # one process, plain module

TorchRec's fused optimizer state names only the tables a rank holds rows of, in an order
that differs between ranks, while a collective put stores one structure: the distributed
put_state/load_state make the nesting the same on every rank (cnrstore.distributed.leaves.uniform;
a rank holding no row of a table names it by a zero-row ``cnrstore.Shard``), so the raw
``{"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}`` works; these
helpers build it, load it back, and map the tracker. The sharded leaves go through
cnrstore.distributed.leaves, which reads TorchRec's real offsets in both output modes.

TorchRec is imported by nobody here: a DMP and a tracker are used through their methods
(``state_dict``, ``fused_optimizer``, ``get_unique_ids``), so cnrstore imports without it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cnrstore.distributed.leaves import is_sharded_leaf, shard_leaf, uniform
from cnrstore.distributed.shard import Shard
from cnrstore.errors import InvalidInput, InvalidType

__all__ = ["state_dict", "load", "load_unsharded", "touched_rows",
           "is_tracker", "resolve_touched"]

_SEP = "/"


def _group_of(dmp):
    env = getattr(dmp, "_env", None)
    return getattr(env, "process_group", None)


def state_dict(dmp, *, optim: bool = True, group=None) -> dict:
    """``{"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}`` with one
    nesting on every rank (collective over the DMP's process group, or ``group``). The
    leaves are TorchRec's own ShardedTensors/DTensors: a put reads them, a load_state
    fills them in place, which writes through to the embedding kernels' storage."""
    state: dict = {"model": dmp.state_dict()}
    if optim:
        fused = getattr(dmp, "fused_optimizer", None)
        if fused is None:
            raise InvalidType(f"{type(dmp).__name__} has no fused_optimizer; pass optim=False")
        state["optim"] = fused.state_dict()
    return uniform(state, group if group is not None else _group_of(dmp))


def load(store, step, dmp, *, optim: bool = True, strict: bool = True, group=None) -> dict:
    """Restore ``step`` into a DistributedModelParallel in place (collective on a store
    opened with ``group=``): any plan and world size the tables were saved under."""
    state = state_dict(dmp, optim=optim, group=group)
    return store.load_state(step, state, strict=strict)


def load_unsharded(store, step, module: torch.nn.Module, *, prefix: str = "",
                   at: str = "model", strict: bool = True) -> dict:
    """Restore the model tables of ``step`` into a plain (unsharded) module in one process:
    a user evaluating a checkpoint on a laptop. ``at`` is where the model's state_dict
    lies in the stored state ("model" for state_dict(dmp)); ``prefix`` is what the DMP's
    keys had before the module's own (``"model."`` for a DLRMTrain saved, a DLRM loaded).
    The optimizer state stays in the store (``store.get_state(step)["optim"]``)."""
    sd = {prefix + k: v for k, v in module.state_dict().items()}
    nest: dict = sd
    for key in reversed(at.split(_SEP)):
        nest = {key: nest}
    return store.load_state(step, nest, strict=strict)


# -- touched rows from TorchRec's ModelDeltaTracker ----------------------------------------

def is_tracker(obj) -> bool:
    """A ModelDeltaTracker, duck-typed: its API changed between TorchRec releases
    (get_delta_ids before 2025, get_unique_ids since)."""
    return not isinstance(obj, Mapping) and any(
        callable(getattr(obj, m, None)) for m in ("get_unique_ids", "get_delta_ids"))


def _tracked_ids(tracker, consumer) -> dict[str, torch.Tensor]:
    for m in ("get_unique_ids", "get_delta_ids"):
        fn = getattr(tracker, m, None)
        if callable(fn):
            try:
                got = fn(consumer) if consumer is not None else fn()
            except ValueError as exc:
                # TorchRec 1.9 raises "torch.cat(): expected a non-empty list of Tensors"
                # when nothing was looked up since the last read: no touched row
                if "non-empty" not in str(exc):
                    raise
                got = {}
            break
    else:
        raise InvalidType(f"{type(tracker).__name__} has no get_unique_ids/get_delta_ids")
    if not isinstance(got, Mapping):
        raise InvalidType(f"the tracker returned a {type(got).__name__}, not a mapping")
    return {str(k): torch.as_tensor(v).flatten().to("cpu", torch.int64) for k, v in got.items()}


def _leaf_paths(state, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(state, Mapping):
        out = []
        for k, v in state.items():
            out += _leaf_paths(v, f"{path}{_SEP}{k}" if path else str(k))
        return out
    return [(path, state)]


def _tables_of(module_fqn: str, leaves: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The sharded leaves holding rows of the table TorchRec calls ``module_fqn``
    (``sparse.embedding_bags.t0``; older trackers say ``....t0.weight`` or only ``t0``):
    its weight and every optimizer state of that weight."""
    fqn = module_fqn.removesuffix(".weight")
    weight = fqn + ".weight"
    out = []
    for path, leaf in leaves:
        parts = path.split(_SEP)
        if not (isinstance(leaf, Shard) or is_sharded_leaf(leaf)):
            continue
        if any(p == weight or (("." not in fqn) and p.endswith(f".{weight}")) for p in parts):
            out.append((path, leaf))
    return out


def touched_rows(tracker, state, *, consumer: str | None = None) -> dict[str, torch.Tensor]:
    """``touched=`` for a put of ``state`` (the helper's, or any nesting holding the DMP's
    sharded leaves): the rows TorchRec's tracker saw looked up since its last read, as
    global row ids of this rank's own shards, for each table and its optimizer states.
    The tracker's ids are shard-local (row i of this rank's shard of a row-wise table is
    global row offset + i). Tables the tracker does not cover are left out: the store
    finds their changed rows by fingerprints. Reading the tracker consumes its ids."""
    ids = _tracked_ids(tracker, consumer)
    # a table the tracker covers but saw no lookup of has no touched row (not: unknown)
    for fqn in (getattr(tracker, "table_to_fqn", None) or {}).values():
        ids.setdefault(str(fqn), torch.zeros(0, dtype=torch.int64))
    leaves = _leaf_paths(state)
    out: dict[str, torch.Tensor] = {}
    for fqn, local in ids.items():
        matched = _tables_of(fqn, leaves)
        if not matched and local.numel():
            raise InvalidInput(f"the tracker names {fqn!r}, which no sharded entry of the "
                               "state holds")
        for path, leaf in matched:
            out[path] = _to_global(path, leaf, local)
    return out


def _to_global(path: str, leaf, local: torch.Tensor) -> torch.Tensor:
    shards = [s for s in (shard_leaf(leaf) or []) if s.local.shape[0]]
    held = sum(int(s.local.shape[0]) for s in shards)
    if local.numel() and (int(local.min()) < 0 or int(local.max()) >= held):
        raise InvalidInput(f"tracked ids of {path!r} reach {int(local.max())}; this rank "
                           f"holds {held} rows of it")
    # a rank's local rows are its shards in row order, one after another
    starts = torch.tensor([0] + [int(s.local.shape[0]) for s in shards]).cumsum(0)
    offsets = torch.tensor([s.row_offset for s in shards] or [0])
    piece = torch.searchsorted(starts[1:], local, right=True)
    return torch.unique(local - starts[piece] + offsets[piece])


# -- touched= given a tracker, through put_state -----------------------------------------

# Ids read from a tracker are gone from it. Until a put that used them returns, they are
# kept here and given again, so a put that fails does not lose rows the next one must write.
_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve_touched(touched, state) -> tuple[Any, Callable[[], None]]:
    """(touched as put_state takes it, a callable to run once the put has returned). A
    tracker becomes its rows; anything else passes through."""
    if touched is None or not is_tracker(touched):
        return touched, lambda: None
    rows = touched_rows(touched, state)
    try:
        before = _pending.get(touched, {})
    except TypeError:  # not weak-referenceable: no carry-over
        before = {}
    for name, ids in before.items():
        rows[name] = torch.unique(torch.cat([rows[name], ids])) if name in rows else ids
    try:
        _pending[touched] = rows
    except TypeError:
        pass

    def done() -> None:
        try:
            _pending.pop(touched, None)
        except TypeError:
            pass

    return rows, done

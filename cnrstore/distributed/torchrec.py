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
cnrstore.distributed.leaves, which reads TorchRec's real offsets in both output modes, and
every sharding type works: column pieces (column-wise, table-column-wise, grid) are joined
into whole rows by the put (cnrstore/distributed/columns.py), and ``load`` maps a
row-wise accumulator kept per column piece onto another plan's pieces.

TorchRec is imported by nobody here: a DMP and a tracker are used through their methods
(``state_dict``, ``fused_optimizer``, ``get_unique_ids``), so cnrstore imports without it.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from cnrstore.core.importing import paused_collector

with paused_collector():  # an entry point users import directly: core/importing.py
    import torch

    from cnrstore.distributed.leaves import global_shape, is_sharded_leaf, row_spans, uniform
    from cnrstore.distributed.shard import Shard
    from cnrstore.errors import CheckpointError, InvalidInput, InvalidType

__all__ = ["state_dict", "load", "load_unsharded", "touched_rows", "plan_note",
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
    return uniform(_raw_state(dmp, optim), group if group is not None else _group_of(dmp))


def _raw_state(dmp, optim: bool) -> dict:
    state: dict = {"model": dmp.state_dict()}
    if optim:
        fused = getattr(dmp, "fused_optimizer", None)
        if fused is None:
            raise InvalidType(f"{type(dmp).__name__} has no fused_optimizer; pass optim=False")
        state["optim"] = fused.state_dict()
    return state


def load(store, step, dmp, *, optim: bool = True, strict: bool = True, group=None,
         at: str = "") -> dict:
    """Restore ``step`` into a DistributedModelParallel in place (collective on a store
    opened with ``group=``): any plan and world size the tables were saved under.
    ``at``: where ``state_dict(dmp)`` lies in the stored state ("" for the top). A
    row-wise accumulator TorchRec keeps per column piece (k pieces: k * rows entries) saved
    under k pieces and loaded under k' != k is mapped through the whole row: the mean of
    the row's k saved entries, given to each of its k' pieces; a table saved data-parallel
    (no fused optimizer state) keeps the fresh state of this plan (docs/TORCHREC.md).
    ``group``: where ``state_dict`` agrees the nesting for a plain store; a distributed
    store agrees it on its own group, in the round that is load_state's first."""
    try:
        return _load(store, step, dmp, optim=optim, strict=strict, group=group, at=at)
    except CheckpointError as exc:
        note = plan_note(dmp, str(exc))
        if note:
            exc.args = (f"{exc} ({note})",)
        raise


def plan_note(dmp, message: str) -> str:
    """The sharding of each table of ``dmp``'s plan that ``message`` names, as text
    ("t3: column_wise on ranks [0, 1]"), or ""."""
    plan = getattr(getattr(dmp, "plan", None), "plan", None)
    said = []
    for mp in (plan.values() if isinstance(plan, Mapping) else ()):
        for table, ps in (mp.items() if hasattr(mp, "items") else ()):
            if re.search(rf"(^|[./'\s]){re.escape(str(table))}([.'\s]|$)", message):
                said.append(f"{table}: {getattr(ps, 'sharding_type', '?')} on ranks "
                            f"{getattr(ps, 'ranks', '?')}")
    return "this DMP's plan: " + "; ".join(said) if said else ""


def _load(store, step, dmp, *, optim: bool, strict: bool, group, at: str) -> dict:
    prefix = f"{at}{_SEP}" if at else ""
    agreed = None
    if callable(getattr(store, "structure", None)):  # a DistributedStore
        # One round of the store's group makes the state uniform, carries the stored
        # shapes _per_piece needs, and is load_state's structure round: it took three
        # (state_dict's on the DMP's group, the shapes', load_state's own) and a broadcast.
        raw, err = None, None
        try:
            raw = _raw_state(dmp, optim)
        except BaseException as exc:  # noqa: BLE001 - every rank raises it in the round
            err = exc
        agreed = store.structure(raw, "torchrec load: structure", error=err,
                                 ask=(lambda st: _shapes(st, step)) if optim else None)
        state, stored = agreed.state, agreed.answer or {}
    else:
        state, stored = state_dict(dmp, optim=optim, group=group), {}
    stored = {k.removeprefix(prefix): v for k, v in stored.items() if k.startswith(prefix)}
    remap, fresh = _per_piece(state, stored) if optim else ({}, set())
    nest: dict = _drop(state, set(remap) | fresh)
    for key in reversed(at.split(_SEP)) if at else ():
        nest = {key: nest}
    if agreed is not None:
        got = store.load_agreed(step, nest, agreed, strict=strict)
    else:
        got = store.load_state(step, nest, strict=strict)
    if remap:
        stored_rows = store.get_tables(step, names=sorted(prefix + p for p in remap))
        from cnrstore.distributed.leaves import fill_leaf

        for path, (leaf, rows, k_saved, k_now) in remap.items():
            saved = stored_rows[prefix + path]
            row = saved.reshape(k_saved, rows).mean(0, dtype=torch.float64)
            mapped = row.to(saved.dtype).repeat(k_now)

            def rows_of(lo: int, hi: int, m: torch.Tensor = mapped) -> torch.Tensor:
                return m[lo:hi]

            fill_leaf(leaf, rows_of)
    return got


def _shapes(st, step) -> dict[str, tuple[int, ...]]:
    """Every table's stored shape in ``step`` (None: the highest), read on the
    coordinator's plain store ``st``; {} where the store holds no step."""
    from cnrstore.format.load import list_steps, load_step, load_table

    if step is None:
        known = list_steps(st.objects)
        step = known[-1] if known else None
    if step is None:
        return {}
    node = load_step(st.objects, step)[1]
    return {n: tuple(load_table(st.objects, oid).shape)
            for n, oid in zip(node.tables, node.table_ids)}


def _per_piece(state, stored: dict) -> tuple[dict[str, tuple], set[str]]:
    """(path -> (leaf, table rows, pieces saved, pieces now) of each optimizer state kept
    per column piece whose piece count differs between the step and this plan; the fused
    optimizer states of tables the step holds without one, saved data-parallel, which
    keep the state TorchRec gave them)."""
    leaves = dict(_leaf_paths(state))
    weights = {p.split(_SEP)[-1]: leaf for p, leaf in leaves.items()
               if p.startswith(f"model{_SEP}") and p.endswith(".weight")}
    out, fresh = {}, set()
    for path, leaf in leaves.items():
        parts = path.split(_SEP)
        if len(parts) < 3 or parts[0] != "optim" or parts[-2] not in weights:
            continue
        if path not in stored:
            if f"model{_SEP}{parts[-2]}" in stored:
                fresh.add(path)
            continue
        shape = (leaf.rows, *map(int, leaf.local.shape[1:])) if isinstance(leaf, Shard) else tuple(
            int(d) for d in leaf.shape)
        w = weights[parts[-2]]
        rows = w.rows if isinstance(w, Shard) else int(w.shape[0])
        saved = stored[path]
        if shape == saved or len(shape) != 1 or len(saved) != 1 or rows == 0:
            continue
        if shape[0] % rows or saved[0] % rows:
            raise InvalidInput(
                f"{path!r}: the step holds {saved[0]} entries, this plan {shape[0]}, and the "
                f"table {parts[-2]!r} has {rows} rows: not a row-wise state per column piece; "
                "load with optim=False, or under the plan it was saved with")
        out[path] = (leaf, rows, saved[0] // rows, shape[0] // rows)
    return out, fresh


def _drop(state, paths: set[str], path: str = ""):
    if not paths or not isinstance(state, Mapping):
        return state
    out = {}
    for k, v in state.items():
        p = f"{path}{_SEP}{k}" if path else str(k)
        if p in paths:
            continue
        kept = _drop(v, paths, p)
        if isinstance(v, Mapping) and v and not kept:
            continue  # every entry dropped: the step holds none of it
        out[k] = kept
    return out


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


def _tables_of(module_fqn: str, leaves: list[tuple[str, Any]], *, plain: bool = False
               ) -> list[tuple[str, Any]]:
    """The sharded leaves holding rows of the table TorchRec calls ``module_fqn``
    (``sparse.embedding_bags.t0``; older trackers say ``....t0.weight`` or only ``t0``):
    its weight and every optimizer state of that weight (``plain``: the plain tensors,
    a data-parallel table's)."""
    fqn = module_fqn.removesuffix(".weight")
    weight = fqn + ".weight"
    out = []
    for path, leaf in leaves:
        parts = path.split(_SEP)
        if plain != (not (isinstance(leaf, Shard) or is_sharded_leaf(leaf))):
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
        if not matched and _tables_of(fqn, leaves, plain=True):
            continue  # a data-parallel table: a plain tensor, diffed by its fingerprints
        if not matched and local.numel():
            raise InvalidInput(f"the tracker names {fqn!r}, which no sharded entry of the "
                               "state holds")
        weight = [(p, lf) for p, lf in matched if p.split(_SEP)[-1].endswith(".weight")]
        base = None
        if weight:  # the table's own rows: its optimizer states follow them
            base = (_rows_of(weight[0][1]), _to_global(weight[0][0], weight[0][1], local))
        for path, leaf in matched:
            out[path] = _follow(path, leaf, local, base)
    return out


def _rows_of(leaf) -> int:
    # ShardedTensor's .shape dispatches through __torch_function__ and warns
    return leaf.rows if isinstance(leaf, Shard) else global_shape(leaf)[0]


def _follow(path: str, leaf, local: torch.Tensor, base) -> torch.Tensor:
    """Global ids of ``leaf`` for the tracker's ``local`` ids of its table. A state of the
    table's row count has the table's rows; a row-wise accumulator kept per column piece
    (k pieces: k * rows entries, piece j's rows at j * rows + row) has every piece's
    entry of each touched row, those this rank holds."""
    if base is None:
        return _to_global(path, leaf, local)
    rows, ids = base
    n = _rows_of(leaf)
    if n == rows:
        return ids
    if rows == 0 or n % rows:
        return _to_global(path, leaf, local)
    every = (torch.arange(n // rows, dtype=torch.int64)[:, None] * rows + ids[None, :]).flatten()
    spans = row_spans(leaf) if not isinstance(leaf, Shard) else (
        [(leaf.row_offset, int(leaf.local.shape[0]))] if leaf.local.shape[0] else [])
    keep = torch.zeros(every.shape, dtype=torch.bool)
    for r, k in spans:
        keep |= (every >= r) & (every < r + k)
    return torch.unique(every[keep])


def _to_global(path: str, leaf, local: torch.Tensor) -> torch.Tensor:
    # a rank's local rows are its pieces' row ranges in row order, one after another (the
    # column pieces of one row range share their ids: TorchRec looks each id up in all)
    spans = row_spans(leaf) if not isinstance(leaf, Shard) else (
        [(leaf.row_offset, int(leaf.local.shape[0]))] if leaf.local.shape[0] else [])
    held = sum(n for _, n in spans)
    if local.numel() and (int(local.min()) < 0 or int(local.max()) >= held):
        raise InvalidInput(f"tracked ids of {path!r} reach {int(local.max())}; this rank "
                           f"holds {held} rows of it")
    starts = torch.tensor([0] + [n for _, n in spans]).cumsum(0)
    offsets = torch.tensor([r for r, _ in spans] or [0])
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

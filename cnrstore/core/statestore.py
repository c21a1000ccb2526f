"""Whole training state and in-place restore on a store handle: put_state, get_state,
load_state and ``get_tables(out=...)`` (docs/GUIDE.md, "Training state and lineage";
cnrstore/core/state.py says how a state is split into tables and a structure).

Functions take the handle's HandleState, like get.py. Restores into existing tensors decode
block by block into the destination rows (restore.read_into), so no second copy of a table
is ever allocated, and every destination's shape and dtype is checked before the first
byte is written.
"""

from __future__ import annotations

from collections.abc import Mapping

from cnrstore.core.get import Located, get, get_tables
from cnrstore.core.handle import HandleState
from cnrstore.core.progress import Reporter, check_progress
from cnrstore.core.put import put
from cnrstore.core.restore import read_many_into
from cnrstore.core.state import (
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
    check_names,
    keep_to_none,
    leaf_names,
    prune,
    select,
)
from cnrstore.core.tablestate import parse_dtype
from cnrstore.core.validate import check_destination
from cnrstore.errors import InvalidInput, InvalidType, ManifestError, TableNotFound
from cnrstore.format.load import load_step
from cnrstore.format.manifest import StepNode

__all__ = ["put_state", "get_state", "load_state", "get_into"]


def put_state(core: HandleState, step, state, *, quant, metadata, blocking, touched,
              progress=None):
    flat = flatten(state)
    if quant is None:
        quant = "exact"
    elif isinstance(quant, str) and quant != "exact":
        # A state mixes float weights with int tensors (RNG state, BatchNorm counters):
        # one scheme for "everything" means every float tensor of ndim >= 2.
        quant = {"*": quant}
    return put(core, step, flat.tables, quant=quant,
               metadata=metadata, blocking=blocking, touched=touched, state=flat.doc,
               progress=progress)


def _stored(core: HandleState, step) -> tuple[int, StepNode, dict[str, tuple[int, ...]]]:
    """(step, step node, table name -> shape as put) of a step."""
    step = core.resolve_step(step)
    _, node = load_step(core.objects, step)
    if node.state is None:
        return step, node, {}
    shapes = check_structure(node.state)
    if set(shapes) != set(node.tables):
        raise ManifestError(f"step {step}: the state structure and the tables disagree")
    return step, node, shapes


def get_state(core: HandleState, step, *, device, names=None, progress=None):
    core.check_open()
    check_names(names)
    if step is None:
        return core.latest(None, lambda s: get_state(core, s, device=device, names=names,
                                                     progress=progress))
    step, node, shapes = _stored(core, step)
    # Selected on the step node alone: only the chosen tables' manifests and blocks are read.
    sel = select(names, leaf_names(node.state, node.tables), step)
    tables = get_tables(
        core, step, names=None if sel.everything else [t for t in node.tables if sel(t)],
        rows=None, device=device, progress=progress)
    if node.state is None:  # a put_tables step: its tables are its state
        return tables
    return unflatten(prune(node.state, sel, NONE_HOLE), stored_leaf(step, tables))


def load_state(core: HandleState, step, state, *, strict: bool, names=None, progress=None):
    core.check_open()
    check_progress(progress)
    check_names(names)
    if step is None:
        return core.latest(None, lambda s: load_state(core, s, state, strict=strict,
                                                      names=names, progress=progress))
    flat = flatten(state)
    for name, t in flat.tables.items():
        check_destination(f"state entry {name!r}", t)
    step, node, shapes = _stored(core, step)
    stored = leaf_names(node.state, node.tables)
    sel = select(names, stored, step)
    given = {n: t for n, t in flat.tables.items() if sel(n)}
    present = set(node.tables)
    missing = [n for n in given if n not in present]
    if missing and strict:  # the first one; strict=False skips them all
        raise TableNotFound(missing[0], step)
    if strict and not sel.everything:  # fill below checks only the entries it is given
        have = set(stored)
        extra = [n for n in leaf_names(flat.doc) if sel(n) and n not in have]
        if extra:
            raise InvalidInput(f"state entry {extra[0]!r} is not in the stored state")
    for name in given:
        if name in shapes and shapes[name] != flat.shapes[name]:
            raise InvalidInput(f"state entry {name!r} has shape {flat.shapes[name]}, step "
                               f"{step} holds {shapes[name]}; nothing was written")
    if node.state is not None:
        doc = prune(node.state, sel, KEEP_HOLE)
        # An empty container the store holds filled (a fresh Adam's "state": {}) gets the
        # stored entries as fresh tensors: left empty, opt.load_state_dict(...) resumed
        # with no optimizer state at all, silently.
        lazy = lazy_tables(state, doc)
        fresh = get_tables(core, step, names=sorted(lazy), rows=None,
                                       device="cpu") if lazy else {}
        result = fill(state, doc, strict=strict and sel.everything,
                      adopt=lambda d: unflatten(keep_to_none(d), stored_leaf(step, fresh)))
    elif strict and sel.everything and _has_python_leaves(flat.doc):
        raise InvalidInput(f"step {step} was put with put_tables and holds no Python values; "
                           "pass only tensors or strict=False")
    else:
        result = state
    get_into(core, step, {n: t for n, t in given.items() if n in present},
             progress=progress)
    return result


def _has_python_leaves(doc) -> bool:
    if "p" in doc:
        return True
    children = [c for _, c in doc["d"]] if "d" in doc else doc.get("l", doc.get("t", []))
    return any(_has_python_leaves(c) for c in children)


def get_into(core: HandleState, step, out: Mapping, *, names=None, rows=None,
             progress=None) -> dict:
    """Decode the tables of ``step`` named by ``out`` into ``out``'s tensors; return them."""
    core.check_open()
    check_progress(progress)
    if names is not None or rows is not None:
        raise InvalidInput("get_tables: out= names the tables; not with names= or rows=")
    if step is None:
        return core.latest(None, lambda s: get_into(core, s, out, progress=progress))
    if not isinstance(out, Mapping):
        raise InvalidType("out must be a mapping table name -> tensor")
    for name, t in out.items():
        check_destination(f"out[{name!r}]", t)
    step = core.resolve_step(step)

    def read(loc: Located, report: Reporter) -> None:
        for name, (tm, _) in loc.tables.items():
            t, node = out[name], tm.node
            if tuple(t.shape) != node.shape or t.dtype != parse_dtype(node.dtype):
                raise InvalidInput(
                    f"out[{name!r}] is {tuple(t.shape)} {t.dtype}; step {step} holds "
                    f"{node.shape} {node.dtype}; nothing was written"
                )
        # detach: restoring into a parameter is not an autograd operation
        read_many_into(loc.objects, core.pool,
                       [(tm, out[name].detach()) for name, (tm, _) in loc.tables.items()],
                       done=report.add if report.fn is not None else None)

    # The get pipeline (core/get.py), the tables named by out= read whole (and seeded,
    # as get_tables seeds them), every shape and dtype checked before the first byte.
    get(core, step, "get_tables", lambda: {n: None for n in out}, read, progress=progress)
    return dict(out)

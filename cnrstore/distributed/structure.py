"""The structure round of the distributed put_state and load_state (and the TorchRec
load's, which carries the coordinator's stored shapes): every rank's state skeleton
all-gathered, the state made uniform from them (cnrstore.distributed.leaves.uniform), and
what else every rank must decide alike from that round: whether any rank's state holds an
empty container load_state could adopt stored entries into."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cnrstore.core.state import MAX_DEPTH
from cnrstore.distributed.leaves import skeleton, uniform
from cnrstore.errors import InvalidType, translate
from engine import StoreError

__all__ = ["Structure", "agree"]


@dataclass
class Structure:
    """What a structure round agreed: ``state`` with one nesting on every rank, every
    rank's ``extras`` and skeleton (``skels``, where every state is a mapping), whether
    every rank's state is free of empty containers after it (``no_empty``: then no rank
    adopts a stored entry into one, and load_state holds no adopt round), and the
    coordinator's ``answer`` to the round's ``ask``."""

    state: Any
    extras: list
    skels: list | None
    no_empty: bool
    answer: Any = None


def agree(ds: Any, state: Any, what: str, error: BaseException | None = None,
          extra: Any = None, ask: Any = None) -> Structure:
    """``state`` with one nesting on every rank, in one round: TorchRec's state names a
    table's optimizer state only where a rank holds its rows
    (cnrstore.distributed.leaves.uniform). ``error`` and ``extra`` are this rank's facts
    of the call that ride the same round (put_state's column join); ``ask(store)`` runs on
    the coordinator, on its plain store, and its answer (or error) rides it too (the
    TorchRec load's stored shapes, which took a round of their own)."""
    # Every rank enters the one round, whether its state is a mapping or its skeleton
    # failed: the kinds, the skeletons and the errors are all-gathered together.
    is_map = isinstance(state, Mapping)
    skel, empty, answer = None, True, None
    try:
        if is_map:
            skel = skeleton(state)
        empty = _has_empty(state)
        if ask is not None and ds.is_coordinator:
            answer = ask(ds.coordinator_store)
    except BaseException as exc:
        error = error or (translate(exc) if isinstance(exc, StoreError) else exc)
    got = ds.comm.agree(error, what, (is_map, skel, extra, empty, answer))
    kinds = [g[0] for g in got]
    extras = [g[2] for g in got]
    no_empty = not any(g[3] for g in got)
    if not any(kinds):
        return Structure(state, extras, None, no_empty, got[0][4])
    if not all(kinds):
        raise InvalidType(f"{what}: the state is a mapping on ranks "
                          f"{[r for r, k in enumerate(kinds) if k]} only")
    skels = [g[1] for g in got]
    return Structure(uniform(state, gather=lambda _mine: skels), extras, skels,
                     no_empty and not _makes_empty(skels), got[0][4])


def _has_empty(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds an empty dict, list or tuple (where load_state may adopt
    stored entries); True past MAX_DEPTH (skeleton raises there)."""
    if depth > MAX_DEPTH:
        return True
    if isinstance(value, (Mapping, list, tuple)):
        if not value:
            return True
        items = value.values() if isinstance(value, Mapping) else value
        return any(_has_empty(v, depth + 1) for v in items)
    return False


def _makes_empty(skels: list) -> bool:
    """Whether ``uniform`` over these skeletons makes an empty dict on some rank: a dict
    another rank has and this one lacks is made from its sharded leaves and dicts only,
    so it is empty where the others hold only plain entries in it."""
    held = [{path for path, _ in sk} for sk in skels]
    dicts: dict[tuple, bool] = {}  # dict path -> it has a sharded leaf or a dict in it
    for sk in skels:
        for path, kind in sk:
            if kind[0] == "D":
                dicts.setdefault(path, False)
            if path and kind[0] in ("D", "S"):
                dicts[path[:-1]] = True
    return any(not filled and any(path not in h for h in held)
               for path, filled in dicts.items())

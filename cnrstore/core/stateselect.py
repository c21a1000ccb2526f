"""Loads of part of a state: the ``names=`` of get_state / load_state (issue 25, part 3).

``names`` is an iterable of leaf names or fnmatch patterns over them, as ``quant=`` keys
are: a leaf's name is its path joined with "/" (``model/emb.weight``, ``epoch``,
``optim/param_groups/0/lr``), tensor and Python leaves alike, and ``*`` crosses "/" (so
``"optim/*"`` is the whole optimizer). Selecting is done on the stored structure, before
any table manifest or block is read, so a partial load reads the selected tables' objects
and nothing else. A name or pattern that matches no stored leaf is an error before
anything is read or written: TableNotFound for a plain name (as ``get_tables(names=)``),
InvalidInput for a pattern (as an unmatched quant pattern).

A pruned structure keeps the containers on the way to a selected leaf: a dict keeps the
selected keys (in order), a list or tuple keeps its length with a ``hole`` where nothing
was selected, so indices keep their meaning.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from fnmatch import fnmatchcase
from typing import Any

from cnrstore.core.quantspec import is_pattern
from cnrstore.core.state import SEP
from cnrstore.errors import InvalidInput, InvalidType, TableNotFound

__all__ = ["Selection", "check_names", "leaf_names", "select", "prune", "NONE_HOLE",
           "KEEP_HOLE", "keep_to_none"]

# get_state's hole: None at an unselected position of a list or tuple.
NONE_HOLE = {"p": None}
# load_state's hole: core/state.py's fill keeps what the caller gave there (an unknown node
# with strict=False); keep_to_none turns it into NONE_HOLE where a subtree is adopted.
KEEP_HOLE = {"keep": None}


def check_names(names: Any) -> list[str] | None:
    """``names`` as a list (None: every leaf); InvalidType for anything but an iterable of
    non-empty str (a lone str too, as get_tables)."""
    if names is None:
        return None
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise InvalidType("names must be an iterable of leaf names or patterns (not a str)")
    out = list(names)
    for n in out:
        if not isinstance(n, str) or not n:
            raise InvalidType(f"names must be non-empty str leaf names or patterns, got {n!r}")
    return out


def _walk(doc: dict, path: str) -> Iterator[tuple[str, dict]]:
    """(path, node) of every leaf of a structure document (core/state.py)."""
    if "T" in doc or "p" in doc:
        yield doc.get("T", path), doc
    elif "d" in doc:
        for key, child in doc["d"]:
            yield from _walk(child, f"{path}{SEP}{key}" if path else str(key))
    else:
        for i, child in enumerate(doc.get("l", doc.get("t", []))):
            yield from _walk(child, f"{path}{SEP}{i}" if path else str(i))


def leaf_names(doc: dict | None, tables: Iterable[str] = ()) -> list[str]:
    """Names of the leaves of a structure document (its tables and Python leaves), or
    ``tables`` for a put_tables step (``doc`` None)."""
    return list(tables) if doc is None else [p for p, _ in _walk(doc, "")]


class Selection:
    """Which leaf names ``names`` picks; ``None`` names pick everything."""

    __slots__ = ("exact", "patterns")

    def __init__(self, names: list[str] | None):
        self.exact = None if names is None else {n for n in names if not is_pattern(n)}
        self.patterns = [] if names is None else [n for n in names if is_pattern(n)]

    @property
    def everything(self) -> bool:
        return self.exact is None

    def __call__(self, name: str) -> bool:
        if self.exact is None:
            return True
        return name in self.exact or any(fnmatchcase(name, p) for p in self.patterns)


def select(names: Any, stored: Iterable[str], step: int) -> Selection:
    """The Selection of ``names`` over a step's ``stored`` leaf names; a name or pattern
    matching none of them is an error (module docstring)."""
    sel = Selection(check_names(names))
    if sel.everything:
        return sel
    stored = list(stored)
    have = set(stored)
    for n in sorted(sel.exact or ()):
        if n not in have:
            raise TableNotFound(n, step)
    unmatched = [p for p in sel.patterns if not any(fnmatchcase(s, p) for s in stored)]
    if unmatched:
        raise InvalidInput(f"names patterns {unmatched} match no leaf of step {step} "
                           f"(leaves: {stored[:20]}{' ...' if len(stored) > 20 else ''})")
    return sel


def prune(doc: dict, sel: Selection, hole: dict) -> dict:
    """``doc`` with only the leaves ``sel`` picks (module docstring); the root container
    is kept even when nothing under it is."""
    if sel.everything:
        return doc

    def walk(node: dict, path: str) -> dict | None:
        if "T" in node or "p" in node:
            return node if sel(node.get("T", path)) else None
        if "d" in node:
            items = []
            for key, child in node["d"]:
                sub = walk(child, f"{path}{SEP}{key}" if path else str(key))
                if sub is not None:
                    items.append([key, sub])
            return {"d": items} if items else None
        kind = "l" if "l" in node else "t"
        kids = [walk(c, f"{path}{SEP}{i}" if path else str(i))
                for i, c in enumerate(node[kind])]
        if all(k is None for k in kids):
            return None
        return {kind: [hole if k is None else k for k in kids]}

    out = walk(doc, "")
    if out is None:
        return {"d": []} if "d" in doc else {"l" if "l" in doc else "t": []}
    return out


def keep_to_none(doc: dict) -> dict:
    """A pruned load_state document with its KEEP_HOLEs as NONE_HOLEs, for
    ``unflatten`` of a subtree adopted whole."""
    if doc is KEEP_HOLE or doc == KEEP_HOLE:
        return NONE_HOLE
    if "d" in doc:
        return {"d": [[k, keep_to_none(c)] for k, c in doc["d"]]}
    for kind in ("l", "t"):
        if kind in doc:
            return {kind: [keep_to_none(c) for c in doc[kind]]}
    return doc


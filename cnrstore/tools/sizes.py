"""Sizes of stored objects for the inspection tools: index lookups cached per object, the
objects a root reaches, and how many indexed objects no root reaches.

cnrstore/tools/info.py's ls, du and gc plan all measure through these, so that each
reads an index entry once and all three agree on one count of "unreachable"; they are
apart from info.py because they are about the engine's objects, not about steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import engine
from engine import ObjectStore, walk

__all__ = ["Sizes", "unreachable"]


class Sizes:
    """Index lookups cached per object: every walk of info.py reads each entry once."""

    def __init__(self, objects: ObjectStore):
        self.objects = objects
        self._info: dict[bytes, engine.ObjectInfo] = {}

    def info(self, oid: bytes) -> engine.ObjectInfo:
        got = self._info.get(oid)
        if got is None:
            got = self._info[oid] = self.objects.info(oid)
        return got

    def reach(self, oid: bytes, into: set[bytes] | None = None) -> set[bytes]:
        """Ids reachable from ``oid`` (itself included), added to ``into``; objects already
        in ``into`` are not walked again. The engine's one DAG walk (engine/store/walk.py)."""
        seen: set[bytes] = set() if into is None else into
        seen |= walk([(oid, "")], lambda o, _via: () if o in seen else self.info(o).refs)
        return seen

    def raw(self, oids: Iterable[bytes]) -> int:
        return sum(self.info(o).raw_len for o in oids)

    def stored(self, oids: Iterable[bytes]) -> int:
        return sum(self.info(o).stored_len for o in oids)


def unreachable(objects: ObjectStore, sizes: Sizes, reached: set[bytes]) -> int:
    """How many indexed objects no root reaches: gc's mark (engine/store/gc.py) walks every root,
    steps and the others (cnrstore/options) alike, and sweeps the rest. ``reached`` holds
    what the caller walked already (it is not changed); the other roots are walked here.
    The one count of "unreachable" that du, the gc dry run and gc itself agree on."""
    seen = set(reached)
    for oid in objects.roots().values():
        sizes.reach(oid, seen)
    return max(objects.stats().objects - len(seen), 0)

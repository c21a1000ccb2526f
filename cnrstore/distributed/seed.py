"""Diff bases of a distributed put's first put of a table in a handle, seeded from the
store: the part that is about ranks (the rule and the reading are core/seed.py's, the
same as a single-process put's).

A rank that owns blocks ``[b0, b1)`` of a table and holds no diff base for them asks the
coordinator, which finds the newest stored step holding the table (core/seed.py
``newest_version``) and sends the table's manifest and the locations of those blocks. The
rank then builds the base of exactly its blocks with ``core.seed.seed_blocks``; its put
compares codes row by row as a single-process seeded put does, so it writes the same
objects.
"""

from __future__ import annotations

from typing import Any

from cnrstore.core.seed import newest_version
from cnrstore.distributed import transfer
from cnrstore.errors import CheckpointError
from engine import StoreError

__all__ = ["answer"]

Need = tuple[str, int, int]   # (table, first block, end block) a rank owns without a base


def answer(objects: Any, needs: list[list[Need]]) -> list[list[Any]]:
    """On the coordinator: per rank, per need, (manifest, anchor, locations) or None."""
    found = {name: newest_version(objects, name)
             for name in sorted({n for ns in needs for n, _, _ in ns})}
    out = []
    for rank, ns in enumerate(needs):
        mine: list[Any] = []
        for name, b0, b1 in ns:
            hit = found[name]
            if hit is None:
                mine.append(None)
                continue
            tm, anchor = hit
            ids = tm.block_ids[b0:b1]
            try:
                where = None if rank == 0 or not ids else transfer.locate(objects, ids)
            except (StoreError, CheckpointError):
                mine.append(None)
                continue
            mine.append((tm, anchor, where))
        out.append(mine)
    return out

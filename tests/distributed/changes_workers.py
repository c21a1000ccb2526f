"""Rank programs of tests/distributed/test_dist_changes.py (module-level: spawned ranks
import them by name)."""

from __future__ import annotations

import torch
from dist_workers import _mine, _open, _table

import cnrstore


def _steps() -> list[torch.Tensor]:
    t1 = _table(1)
    t2 = t1.clone()
    t2[[3, 50, 120, 190]] += 1.0
    t3 = t2.clone()
    t3[[4, 120, 199]] -= 2.0
    return [t1, t2, t3]


def served_changes(rank: int, world: int, where):
    """Steps 1-3 put sharded; each rank then asks for the changes of its own rows, forward
    and back; a step that is not kept, or a table one rank names wrongly, fails on every
    rank."""
    with _open(where) as s:
        for step, t in enumerate(_steps(), start=1):
            s.put_tables(step, {"t": _mine(t, rank, world), "dense": torch.ones(3) * step})
        lo, hi = (0, 100) if rank == 0 else (100, 200)
        out = {}
        for a, b in ((1, 3), (3, 1), (2, 3), (3, 3)):
            got = s.changes(a, b, rows={"t": slice(lo, hi)})
            out[(a, b)] = [(c.table, c.kind, c.rows.tolist(), c.values.clone()) for c in got]
        for key, names in (("missing", None), ("table", ["t"] if rank == 0 else ["nope"])):
            try:
                s.changes(1, 9 if key == "missing" else 3, names)
            except cnrstore.CheckpointError as exc:
                out[key] = type(exc).__name__
        return out

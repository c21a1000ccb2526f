"""The demo's serving copy: a replica of the model's tables that follows the store by
``store.changes`` only (docs/GUIDE.md, "Publishing changes").

It starts from a full restore of the first kept step, then every ``every``-th step is
published as the changes from the step the copy holds, and the copy is checked against
``get_tables`` of that step: bit for bit under "exact", the stored values under a lossy
scheme (what a restore returns). The changes cross the kill and resume of the demo's
trainer like any other steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

__all__ = ["Published", "follow"]

SERVED = "model/*"  # the serving copy holds the model, not the optimizer state


@dataclass(frozen=True)
class Published:
    steps: tuple[int, ...]     # the steps the copy followed, the first one restored
    rows: int                  # rows sent as changes, all publishes
    bytes_sent: int            # ids and values sent as changes
    bytes_full: int            # what sending each published step in full would have cost
    identical: bool            # the copy equalled the store at every published step

    def line(self) -> str:
        return (f"serving copy: followed steps {list(self.steps)} by changes only: "
                f"{self.rows:,} rows, {self.bytes_sent / 1e6:.2f} MB sent vs "
                f"{self.bytes_full / 1e6:.2f} MB as full copies; "
                + ("identical to the store at every step" if self.identical
                   else "DIFFERS from the store"))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same(copy: dict, want: dict) -> bool:
    if sorted(copy) != sorted(want):
        return False
    for name, t in want.items():
        c = copy[name]
        if c.dtype != t.dtype or c.shape != t.shape:
            return False
        if not torch.equal(c.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)):
            return False
    return True


def follow(store, *, every: int = 1, pattern: str = SERVED) -> Published:
    """Follow the store's kept steps with a serving copy of the tables matching
    ``pattern``, publishing every ``every``-th step (and the last one)."""
    steps = store.steps()
    if not steps:
        raise ValueError("the store holds no steps to serve")
    published = steps[::every]
    if published[-1] != steps[-1]:
        published.append(steps[-1])
    names = [n for n in store.get_tables(steps[0]) if fnmatchcase(n, pattern)]
    copy = store.get_tables(steps[0], names=names)
    held, rows, sent, full, ok = steps[0], 0, 0, 0, True
    for step in published[1:]:
        for ch in store.changes(held, step, names):
            ch.apply(copy)
            rows += len(ch.rows)
            sent += _nbytes(ch.rows) + _nbytes(ch.values)
        held = step
        want = store.get_tables(step, names=names)
        full += sum(_nbytes(t) for t in want.values())
        ok = ok and _same(copy, want)
    return Published(tuple(published), rows, sent, full, ok)

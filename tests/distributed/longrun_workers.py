"""Rank programs of test_dist_longrun.py (module-level: spawned ranks import them by name)."""

from __future__ import annotations

import torch

import cnrstore

ROWS, STEPS = 160, 10
OPTS = {"block_rows": 16, "fanout": 3, "max_chain": 3}


def longrun_tables(step: int) -> torch.Tensor:
    """The table of ``step``: hot rows 1 and 2 of every block change at every step, a
    few others now and then, so chains reach their caps and are merged."""
    g = torch.Generator().manual_seed(11)
    t = torch.randn(ROWS, 3, generator=g)
    for s in range(1, step + 1):
        hot = torch.tensor([b * 16 + r for b in range(ROWS // 16) for r in (1, 2)])
        t[hot] += float(s)
        t[(s * 7) % ROWS] -= 1.0
    return t


def longrun_put(rank: int, world: int, path: str, options: dict | None = None):
    """STEPS puts of the table, the ranks holding uneven pieces of it."""
    import torch.distributed as dist

    cut = [0, 50, ROWS] if world == 2 else [0, 30, 100, ROWS]
    ids = []
    with cnrstore.open(path, group=dist.group.WORLD, timeout=30, **(options or OPTS)) as s:
        for step in range(STEPS):
            t = longrun_tables(step)
            mine = cnrstore.Shard(t[cut[rank]:cut[rank + 1]], row_offset=cut[rank], rows=ROWS)
            ids.append(s.put_tables(step, {"t": [mine]}).tables)
    return ids


GROUPED = {"block_rows": 16, "fanout": 3, "layout": "grouped"}


# 64-row blocks: objects of a step stay listed at later steps (the hot rows leave them)
GROUPED_WIDE = {"block_rows": 64, "fanout": 3, "layout": "grouped"}


def grouped_put(rank: int, world: int, path: str, options: dict | None = None):
    """longrun_put in the grouped layout (lists of row objects, core/grouppolicy.py)."""
    return longrun_put(rank, world, path, options or GROUPED)

"""Tables whose values say where they are, and the check that Shards tile them."""

from __future__ import annotations

import torch


def table(name: str, shape) -> torch.Tensor:
    """A global tensor whose every element says where it is: row * 1000 + column + a
    per-name base, so a row read from the wrong offset is caught."""
    base = sum(map(ord, name)) * 100_000
    rows = torch.arange(shape[0], dtype=torch.float64)[:, None] * 1000
    cols = torch.arange(int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1,
                        dtype=torch.float64)[None, :]
    return (base + rows + cols).reshape(shape).float()


def describe(shards):
    return [(s.row_offset, s.rows, tuple(s.local.shape), s.local.clone()) for s in shards]


def check_tiling(per_rank, gshape, name):
    """The Shards of all ranks cover rows 0..n exactly once, with the table's values."""
    n = gshape[0]
    seen = torch.zeros(n, dtype=torch.int64)
    for shards in per_rank:
        for off, rows, shape, local in shards:
            assert rows == n and shape[1:] == tuple(gshape[1:])
            seen[off:off + shape[0]] += 1
            torch.testing.assert_close(local, table(name, gshape)[off:off + shape[0]])
    assert seen.eq(1).all(), f"{name}: rows covered {seen.tolist()}"

"""DLRM-like embedding tables and the row updates a training interval applies to them.

Everything is a pure function of a seed, so every system in a benchmark run (each in its
own subprocess) sees bit-identical tables at every step without shipping gigabytes between
processes.

Update model: an interval changes exactly ``fraction`` of each table's rows (a checkpoint
store sees "rows changed", not "lookups made"). Which rows:

- ``uniform``: a uniform sample without replacement.
- ``zipf``: a weighted sample without replacement where the row of popularity rank r has
  weight 1 / (r + 1) ** s (Efraimidis-Spirakis keys), so the same hot rows change in every
  interval. Ranks map to row ids through a fixed per-table permutation: real hot ids are
  scattered over the table (hashed feature ids), not packed at its start, and a store must
  not profit from an artificial locality.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

__all__ = [
    "BASE_ROWS",
    "DIM",
    "Workload",
    "apply_update",
    "changed_rows",
    "make_tables",
    "table_specs",
]

DIM = 64
# Five tables of different sizes, 4.2 M rows x 64 fp32 = 1.075 GB (1.0014 GiB) at scale 1:
# the default run is >= 1 GiB, as asked.
BASE_ROWS = (2_000_000, 1_200_000, 600_000, 300_000, 100_000)
MIN_ROWS = 16
DISTRIBUTIONS = ("zipf", "uniform")
ZIPF_S = 1.05
# An SGD-like step: small relative to the init range, but it changes every bit pattern.
UPDATE_STD = 1e-3


@dataclasses.dataclass(frozen=True)
class Workload:
    """One update pattern: ``fraction`` of the rows change per interval, drawn by ``dist``."""

    fraction: float
    dist: str

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {self.dist!r}")

    @property
    def name(self) -> str:
        pct = f"{self.fraction * 100:g}"
        return f"{self.dist}-{pct}pct"


def table_specs(*, scale: float = 1.0, dim: int = DIM) -> dict[str, tuple[int, int]]:
    """Table name -> (rows, dim). ``scale`` multiplies every table's row count."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim!r}")
    return {
        f"t{i}": (max(MIN_ROWS, int(round(rows * scale))), dim)
        for i, rows in enumerate(BASE_ROWS)
    }


def _generator(seed: int, *salt: int) -> torch.Generator:
    # Mix the salt into one 63-bit seed so tables and steps get independent streams.
    key = np.random.SeedSequence([seed, *salt]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(key) & 0x7FFF_FFFF_FFFF_FFFF)


def make_tables(specs: dict[str, tuple[int, int]], *, seed: int) -> dict[str, torch.Tensor]:
    """Fresh fp32 tables, uniform in +-1/sqrt(rows) like DLRM's initializer."""
    tables = {}
    for i, (name, (rows, dim)) in enumerate(specs.items()):
        bound = 1.0 / float(np.sqrt(rows))
        t = torch.empty(rows, dim, dtype=torch.float32)
        t.uniform_(-bound, bound, generator=_generator(seed, 1, i))
        tables[name] = t
    return tables


def _permutation(rows: int, seed: int, table_index: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 2, table_index])
    return rng.permutation(rows)


def changed_rows(
    rows: int, workload: Workload, *, seed: int, step: int, table_index: int
) -> np.ndarray:
    """Sorted int64 ids of the rows ``workload`` changes in interval ``step``."""
    k = max(1, int(round(workload.fraction * rows)))
    rng = np.random.default_rng([seed, 3, step, table_index])
    if k >= rows:
        return np.arange(rows, dtype=np.int64)
    if workload.dist == "uniform":
        picked = rng.choice(rows, size=k, replace=False)
    else:
        # Efraimidis-Spirakis: the k largest of u ** (1 / w) are a weighted sample without
        # replacement; in log space that is log(u) / w = log(u) * (rank + 1) ** s.
        ranks = np.arange(1, rows + 1, dtype=np.float64)
        keys = np.log(rng.random(rows)) * ranks**ZIPF_S
        top_ranks = np.argpartition(keys, rows - k)[rows - k :]
        picked = _permutation(rows, seed, table_index)[top_ranks]
    return np.sort(picked.astype(np.int64))


def apply_update(
    tables: dict[str, torch.Tensor],
    workload: Workload,
    *,
    seed: int,
    step: int,
    touched: dict[str, np.ndarray] | None = None,
) -> int:
    """Apply interval ``step``'s update in place; returns the number of rows changed.

    ``touched``, when given, receives each table's changed row ids (what a trainer that
    tracks its lookups would hand to the store)."""
    total = 0
    for i, (name, t) in enumerate(tables.items()):
        ids = changed_rows(t.shape[0], workload, seed=seed, step=step, table_index=i)
        if touched is not None:
            touched[name] = ids
        delta = torch.randn(
            len(ids), *t.shape[1:], dtype=t.dtype, generator=_generator(seed, 4, step, i)
        )
        t.index_add_(0, torch.from_numpy(ids).to(t.device), delta.mul_(UPDATE_STD).to(t.device))
        total += len(ids)
    return total

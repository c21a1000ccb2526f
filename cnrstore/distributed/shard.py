"""``Shard``: one rank's rows of a table in a distributed put (docs/GUIDE.md, "Many ranks
and object stores").

A table that lives on many ranks is given on each rank as the rows it holds:
``Shard(local, row_offset=lo, rows=n_total)`` says that ``local`` holds global rows
``lo .. lo + len(local)`` of a table of ``n_total`` rows. The shards of all ranks must tile
the table exactly; a rank may give several shards of one table (a list of Shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cnrstore.errors import InvalidInput, InvalidType


@dataclass(frozen=True)
class Shard:
    local: Any          # torch.Tensor: rows [row_offset, row_offset + local.shape[0])
    row_offset: int
    rows: int           # the whole table's row count (the same on every rank)

    def __post_init__(self) -> None:
        shape = getattr(self.local, "shape", None)
        if shape is None:
            raise InvalidType(f"Shard.local must be a tensor, got {type(self.local).__name__}")
        if len(shape) < 1:
            raise InvalidInput("Shard.local must have ndim >= 1 (rows are dim 0)")
        for name in ("row_offset", "rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidType(f"Shard.{name} must be an int, got {type(v).__name__}")
        if self.row_offset < 0 or self.rows < 0:
            raise InvalidInput(f"Shard row_offset={self.row_offset} and rows={self.rows} "
                               "must be >= 0")
        if self.row_offset + int(shape[0]) > self.rows:
            raise InvalidInput(f"Shard rows {self.row_offset}..{self.row_offset + shape[0]} "
                               f"lie beyond the table's {self.rows} rows")

    @property
    def row_end(self) -> int:
        return self.row_offset + int(self.local.shape[0])

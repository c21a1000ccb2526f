"""How a world of one reads: its own store (the get pipeline's ``Reader`` for
CheckpointStore; core/get.py. Many ranks read the blocks the coordinator located for
them instead: cnrstore/distributed/read.py).

This process is the coordinator and the only reader: the answer needs no locations,
the blocks are read from the handle's own object store, every error is raised as it is
(not a copy naming a rank), and the tables read whole seed the handle's diff bases
(core/seed.py ``seed_later``), as the put's world of one seeds a table's first put.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cnrstore.core.get import Located
from cnrstore.core.seed import seed_later
from cnrstore.errors import CheckpointError

__all__ = ["OwnStore"]


class OwnStore:
    """The blocks of a read come from the handle's own store."""

    def begin(self, h: Any) -> None:
        return None  # the entry checked the handle and waited for the step (resolve_step)

    def store(self, h: Any) -> Any:
        return h.objects

    def blame(self, exc: CheckpointError, rank: int) -> BaseException:
        return exc

    def where(self, objects: Any, oids: list[bytes], rank: int) -> Any:
        return None

    def source(self, h: Any, where: Any) -> Any:
        return h.objects

    def close(self, h: Any, err: BaseException | None, what: str) -> None:
        h.group.agree(err, what)  # a world of one raises its own error

    def seed(self, h: Any, loc: Located, rows: Mapping | None) -> None:
        # The diff bases of the restored tables are computed from the stored step after
        # the restore returns (seed.seed_later); the next put of a table waits for its own.
        for name, (tm, _) in loc.tables.items():
            if (not rows or rows.get(name) is None) and h.wants_seed(name):
                h.seed(name, tm, None, None, loc.anchor,
                       deferred=seed_later(h.objects, tm))

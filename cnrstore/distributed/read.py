"""How the ranks of a DistributedStore read (the get pipeline's ``Reader`` for ranks;
core/get.py drives it: get_tables here, get_state and load_state in statestore.py, the
DCP reader's load). The coordinator answers each rank with the table manifests and the
locations of exactly the blocks (with their patch chains) that overlap its rows; each
rank then reads those records from the store's pack storage (transfer.py) and decodes
with core/restore.py; a block whose rows several ranks' destinations share is read by one
of them, which sends the others their rows (boundary.py). Every rank returns, or every
rank raises; a read that met a pack a gc moved is read once more with fresh locations
(``transfer.again``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cnrstore.core.get import Located, get, read_rows, request
from cnrstore.core.progress import check_progress
from cnrstore.core.validate import check_destination, check_device, check_selection
from cnrstore.distributed import transfer
from cnrstore.distributed.boundary import Exchange, fill_rows, row_kind
from cnrstore.distributed.comm import rebuild_error, wire_error
from cnrstore.distributed.shard import Shard
from cnrstore.errors import CheckpointError, InvalidInput, InvalidType, translate
from engine import StoreError

# The DistributedStore (cnrstore/distributed/store.py, which imports this module): typed loosely
# so the layers test sees no import cycle.
DistributedStore = Any

__all__ = ["RankBlocks", "get_tables"]

Ranges = list[tuple[int, int]]


class RankBlocks:
    """Each rank reads the blocks the coordinator located for it; the coordinator reads
    its own store."""

    def begin(self, ds: DistributedStore) -> None:
        ds.check_open()
        ds.drain()

    def store(self, ds: DistributedStore) -> Any:
        return ds.local.objects

    def blame(self, exc: CheckpointError, rank: int) -> BaseException:
        return rebuild_error(wire_error(exc), rank)

    def where(self, objects: Any, oids: list[bytes], rank: int) -> Any:
        return None if rank == 0 or not oids else transfer.locate(objects, oids)

    def source(self, ds: DistributedStore, where: Any) -> Any:
        if ds.is_coordinator:
            return ds.local.objects
        return ds.readers.source(where) if where is not None else None

    def exchange(self, ds: DistributedStore, plan: Any) -> Exchange:
        return Exchange(ds.comm, plan, ds.buffers)

    def close(self, ds: DistributedStore, err: BaseException | None, what: str) -> None:
        """Every rank raises the lowest rank's error, or, when the only errors were packs
        gone under a rank, the signal ``transfer.again`` retries."""
        moved = getattr(ds, "retry_moved", False) and transfer.moved(err)
        if isinstance(err, StoreError):  # on the wire as cnrstore's own (CorruptData...)
            translated = translate(err)
            translated.__cause__, err = err, translated
        if any(ds.comm.agree(None if moved else err, what, moved)):
            transfer.moved_everywhere(what)

    def seed(self, ds: DistributedStore, loc: Located, rows: Mapping | None) -> None:
        return None  # a rank's bases are seeded at its next put (distributed/seed.py)


def get_tables(ds: DistributedStore, step: Any, *, names: Any, rows: Any, device: Any,
               out: Any, progress: Any = None) -> dict:
    def make() -> dict:
        check_progress(progress)
        if out is not None:
            if names is not None or rows is not None:
                raise InvalidInput("get_tables: out= names the tables; not with names= or rows=")
            if not isinstance(out, Mapping):
                raise InvalidType("out must be a mapping table name -> tensor or Shard")
            return {n: _out_spec(n, t) for n, t in out.items()}
        check_device(device)
        wanted, sel_rows = check_selection(names, rows)
        for n, sel in sel_rows.items():
            if not isinstance(sel, slice):
                raise InvalidType(f"rows[{n!r}] must be a slice, got {type(sel).__name__}")
        return request(wanted, sel_rows)

    if out is None:
        return get(ds, step, "get_tables", make, read_rows(ds, device, rows),
                   progress=progress, rows=rows)

    def read(loc: Located, report: Any) -> dict:
        fill_rows(ds, loc, [(n, 0, out[n]) for n in loc.tables],
                  done=report.add if report.fn is not None else None)
        return {n: out[n] for n in loc.tables}

    return get(ds, step, "get_tables", make, read, progress=progress)


def _out_spec(name: str, t: Any) -> Any:
    if isinstance(t, Shard):
        check_destination(f"out[{name!r}]", t.local)
        return (row_kind([t.local]), [(t.row_offset, t.row_end, tuple(t.local.shape[1:]),
                            str(t.local.dtype).removeprefix("torch."))])
    if not isinstance(t, torch.Tensor):
        raise InvalidType(f"out[{name!r}] must be a torch.Tensor or Shard, got "
                          f"{type(t).__name__}")
    check_destination(f"out[{name!r}]", t)
    return ("whole", tuple(t.shape), str(t.dtype).removeprefix("torch."))



"""``StorageWriter``: DCP's save into one cnrstore step (docs/GUIDE.md, "From DCP").

DCP's steps and what this writer does in them:

- ``prepare_local_plan`` (every rank): each tensor chunk holds whole rows, or the whole
  rows' columns of a 2-D tensor (TorchRec's column-wise and grid plans); a chunk cut
  along a later dim is refused, naming the FQN.
- ``prepare_global_plan`` (coordinator): the document of the step (docmeta.py) from all
  plans, the quant patterns checked against the FQNs; every rank's plan carries it.
- ``write_data`` (every rank): the chunks DCP resolves become ``Shard``s of the FQN's
  table, the bytes items are gathered, and ONE collective ``put_tables`` writes the step:
  row shards on the global row grid, diffed against the store's bases, so a later save
  writes only the rows that changed and the blocks are those of ``put_tables`` of the
  same tensors (column chunks are first joined into whole rows of an even split,
  cnrstore/distributed/columns.py). A rank's failure reaches every rank before anything
  is written.
- ``finish`` (coordinator): nothing is left to do; the step committed in write_data
  (cnrstore's commit is collective, DCP's finish runs on the coordinator alone).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DCPWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import cnrstore.dcp.docmeta as docmeta
from cnrstore.codec.layout import dtype_name, parse_dtype
from cnrstore.core.options import Options
from cnrstore.core.quantspec import resolve_quant
from cnrstore.core.validate import check_step, pack_metadata
from cnrstore.core.writer import StepInfo
from cnrstore.dcp.handle import Target
from cnrstore.distributed import columns
from cnrstore.distributed.shard import Shard
from cnrstore.distributed.store import DistributedStore
from cnrstore.errors import InvalidInput
from cnrstore.format.manifest import root_name

__all__ = ["StorageWriter"]


def _rows_only(item: Any) -> None:
    """A chunk of whole rows, or of whole rows' columns (a 2-D tensor cut along dim 1,
    as TorchRec's column-wise plans give): the latter are joined into whole rows."""
    td = item.tensor_data
    offsets, sizes, size = list(td.chunk.offsets), list(td.chunk.sizes), list(td.size)
    if offsets[2:] != [0] * (len(size) - 2) or sizes[2:] != size[2:]:
        raise InvalidInput(
            f"DCP save: {item.index.fqn!r} is sharded along a dim past the columns (chunk "
            f"at {offsets} of size {sizes} in {size}); cnrstore stores whole rows and joins "
            "row and column pieces only")


def _is_column(td: Any) -> bool:
    size = list(td.size)
    return len(size) >= 2 and (int(td.chunk.offsets[1]) != 0 or int(td.chunk.sizes[1]) != size[1])


class StorageWriter(_DCPWriter):
    """DCP storage writer into ``step`` of a cnrstore store: ``store`` is an open store
    (``cnrstore.open(path)``, or with ``group=`` for many ranks; it keeps its diff bases
    between saves) or a path, opened on every rank for the save and closed after (with
    ``group``, default the world when torch.distributed runs on many ranks, ``False`` for
    this process alone, and the keyword arguments of ``cnrstore.open``). ``quant`` as in
    ``put_state``: a scheme, or fnmatch patterns over the FQNs; ``metadata`` is the step's
    user metadata (its key ``"dcp"`` is the writer's). After the save, ``info`` is the
    step's StepInfo."""

    def __init__(self, store: Any, step: int, *, quant: Any = "exact",
                 metadata: Mapping | None = None, group: Any = None, **open_kwargs: Any):
        super().__init__()
        check_step(step)
        self.target = Target(store, group, open_kwargs)
        self.step = step
        self.quant = quant
        self.user_metadata = pack_metadata(metadata)
        if docmeta.KEY in self.user_metadata:
            raise InvalidInput(f"metadata key {docmeta.KEY!r} is the DCP writer's own")
        self.info: StepInfo | None = None
        self.is_coordinator = False

    # -- DCP's interface -----------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.target.reset(checkpoint_id)
        self.info = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked by DCP for a bare checkpoint_id: pass a writer

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                _rows_only(item)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        doc = docmeta.build(plans)
        metas = {fqn: torch.empty(docmeta.table_shape(size), dtype=parse_dtype(dt),
                                  device="meta")
                 for fqn, (dt, size, _, _) in doc["tensors"].items()}
        # A typo in a quant pattern fails here, before any rank writes.
        resolve_quant(self.quant, metas, expected_restores=Options().expected_restores)
        return [dataclasses.replace(p, storage_data=doc) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.info = None
        try:
            store = self.target.open()
            try:
                self.info, results = self._write(store, plan, planner)
            finally:
                info = self.info
                self.target.done(None if info is None else
                                 (root_name(self.step), bytes.fromhex(info.root)))
        except BaseException:
            self.info = None
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        return None

    # -- the save ------------------------------------------------------------------------
    def _write(self, store: Any, plan: SavePlan, planner: SavePlanner
               ) -> tuple[StepInfo, list[WriteResult]]:
        err: BaseException | None = None
        tables: dict[str, list[Shard]] = {}
        values: dict[str, bytes] = {}
        results: list[WriteResult] = []
        cols: dict[str, tuple] = {}  # fqn -> (size, dtype, column pieces): joined below
        try:
            if not isinstance(plan.storage_data, Mapping):
                raise InvalidInput("DCP save: the plan lacks the writer's document (a planner "
                                   "dropped SavePlan.storage_data)")
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    values[item.index.fqn] = data.getvalue()
                    results.append(WriteResult(item.index, len(values[item.index.fqn]), None))
                    continue
                assert isinstance(data, torch.Tensor)
                td = item.tensor_data
                assert td is not None
                size = list(td.size)
                if _is_column(td):
                    cols.setdefault(item.index.fqn, (tuple(int(d) for d in size),
                                                     dtype_name(td.properties.dtype), []))
                    cols[item.index.fqn][2].append((data.detach(), int(td.chunk.offsets[0]),
                                                    int(td.chunk.offsets[1])))
                    results.append(WriteResult(item.index, data.numel() * data.element_size(),
                                               None))
                    continue
                t = data.detach().reshape(docmeta.table_shape(list(td.chunk.sizes)))
                row = int(td.chunk.offsets[0]) if size else 0
                tables.setdefault(item.index.fqn, []).append(
                    Shard(t, row_offset=row, rows=docmeta.table_shape(size)[0]))
                results.append(WriteResult(item.index, t.numel() * t.element_size(), None))
        except BaseException as exc:
            err = exc
        got = self.target.agree(err, "DCP save: items", values)
        doc = dict(plan.storage_data)  # the same on every rank: the coordinator's
        given = {fqn: v for g in got for fqn, v in g.items()}
        doc["bytes"] = {fqn: given[fqn] for fqn in doc["bytes"] if fqn in given}
        meta = {**self.user_metadata, docmeta.KEY: doc}
        put: Mapping = tables
        if not isinstance(store, DistributedStore):
            put = {fqn: _whole(fqn, shards) for fqn, shards in tables.items()}
            put.update({fqn: columns.whole(fqn, size[0], size[1], pcs)
                        for fqn, (size, _, pcs) in cols.items()})
        else:
            # column chunks become whole rows of an even split (every rank enters)
            joined = columns.join_pieces(store, cols, None, "DCP save: columns")
            if joined.specs:
                err = None
                got_rows: dict = {}
                try:
                    got_rows = joined.shards()
                except BaseException as exc:
                    err = exc
                self.target.agree(err, "DCP save: columns assembled", None)
                tables.update({fqn: [shard] for fqn, shard in got_rows.items()})
        info = store.put_tables(self.step, put, quant=self.quant, metadata=meta)
        return info, results


def _whole(fqn: str, shards: list[Shard]) -> torch.Tensor:
    """One process holds every chunk of a table: the table itself (chunks must tile it)."""
    shards = sorted(shards, key=lambda s: s.row_offset)
    pos = 0
    for s in shards:
        if s.row_offset != pos:
            raise InvalidInput(f"DCP save: {fqn!r}: rows {pos}..{s.row_offset} are in no "
                               "chunk of this process (a one-process store needs them all)")
        pos = s.row_end
    if pos != shards[0].rows:
        raise InvalidInput(f"DCP save: {fqn!r}: rows {pos}..{shards[0].rows} are in no chunk "
                           "of this process (a one-process store needs them all)")
    if len(shards) == 1:
        return shards[0].local
    return torch.cat([s.local for s in shards])

"""``StorageReader``: DCP's load out of one cnrstore step (docs/GUIDE.md, "From DCP").

``read_metadata`` gives DCP the step's document (docmeta.py) as its Metadata: each tensor
one chunk, the whole table, so DCP's planner turns any target sharding into reads of row
ranges (and, for a target cut along other dims, column ranges of those rows).
``read_data`` reads, per table, the rows this rank's reads span, in ONE collective read
(each rank reads only the blocks overlapping its rows; its request round carries the
rank's plan, or its error): a piece of whole rows decodes straight into the tensor DCP
resolves for it (a block such pieces of two ranks share is read by one of them, which
sends the other its rows: distributed/boundary.py), the rows of the others are read and
each read's rectangle copied.
The metadata read also brings where the step's blocks lie, and ``prepare_local_plan``
hints this rank's first blocks while DCP plans (early.py).
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DCPReader
from torch.futures import Future

import cnrstore.dcp.docmeta as docmeta
from cnrstore.codec.layout import dtype_name
from cnrstore.core.get import Located, get
from cnrstore.core.prefault import Prefault
from cnrstore.core.restore import new_output
from cnrstore.core.validate import check_step
from cnrstore.dcp import early
from cnrstore.dcp.handle import Target
from cnrstore.distributed import transfer
from cnrstore.distributed.boundary import fill_rows
from cnrstore.distributed.shard import Shard
from cnrstore.distributed.store import DistributedStore
from cnrstore.errors import InvalidInput, StepNotFound, engine_errors

__all__ = ["StorageReader"]


def _rows(item: ReadItem) -> tuple[int, int]:
    if not len(item.lengths):  # a scalar: the table's one row
        return 0, 1
    lo = int(item.storage_offsets[0])
    return lo, lo + int(item.lengths[0])


class StorageReader(_DCPReader):
    """DCP storage reader of ``step`` (None: the latest) of a cnrstore store: an open
    store, or a path opened on every rank for the load and closed after (``group`` and
    the keyword arguments of ``cnrstore.open``, as for StorageWriter)."""

    def __init__(self, store: Any, step: int | None = None, *, group: Any = None,
                 **open_kwargs: Any):
        super().__init__()
        if step is not None:
            check_step(step)
        self.target = Target(store, group, open_kwargs)
        self.step = step
        self.doc: dict | None = None
        self.read_step: int | None = None
        self.early: tuple[Any, early.Locations] | None = None  # (source, where blocks lie)

    # -- DCP's interface -----------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.target.reset(checkpoint_id)
        self.doc = None
        self.read_step = None
        self.early = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked by DCP for a bare checkpoint_id: pass a reader

    def read_metadata(self) -> Metadata:
        # No **kwargs: DCP would then retry with rank= for per-rank metadata there is none of.
        # A path is opened here and again in read_data: DCP calls nothing after a failed
        # plan (a shape that does not match), so a store kept open between the two would
        # stay open, its index locked, in a job that goes on.
        try:
            # A path opened now: the coordinator reads the document as it opens, and the
            # open's round brings it (no rounds of the metadata's own: ~8 ms of a cold
            # load, before which no rank knows what to read).
            store = self.target.open(first=self._first)
            if self.target.first is not None:
                step, doc, locs = self.target.first()
                if step is None:
                    raise _no_step()
            else:
                step = self.step
                if step is None:
                    steps = store.steps()
                    if not steps:
                        raise _no_step()
                    step = steps[-1]
                s = step
                if isinstance(store, DistributedStore):  # the coordinator's, in one round
                    doc, locs = store.coordinated("metadata", lambda c: _document(c, s))
                else:
                    doc, locs = _document(store, s)
            if doc is None:
                raise InvalidInput(f"step {step} was not written through DCP (no DCP metadata); "
                                   "read it with get_tables or get_state")
            md = docmeta.to_metadata(doc, step)
            self.early = None if locs is None else (_hint_source(store), locs)
        finally:
            self.target.done()
        self.doc, self.read_step = doc, step
        return md

    def _first(self, coordinator: Any) -> tuple[int | None, dict | None,
                                                early.Locations | None]:
        """What the open's round brings every rank (``_latest_document``); the coordinator
        hints meanwhile the first blocks each rank would read of an even cut (early.py):
        the disk reads from the open on, ~10 ms before any rank's plan."""
        got = _latest_document(coordinator, self.step)
        if got[2] is not None:
            early.hint(coordinator.objects, early.even_split(
                got[2], dist.get_world_size(self.target.group_of())),
                early.patches(got[2]))
        return got

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # The first point this rank knows its rows: their first blocks hinted (early.py).
        if self.early is not None:
            source, locs = self.early
            self.early = None
            spans = [(i.storage_index.fqn, *_rows(i)) for i in plan.items
                     if i.type != LoadItemType.BYTE_IO]
            early.hint(source, early.plan(locs, spans), early.patches(locs, spans))
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            self.target.open()
            self._read(plan, planner)
        finally:
            self.target.done()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- the load ------------------------------------------------------------------------
    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        err: BaseException | None = None
        spans: dict[str, tuple[int, int]] = {}
        direct: dict[str, Any] = {}     # fqn -> the destination cnrstore decodes into
        copied: list[tuple[ReadItem, torch.Tensor]] = []
        try:
            doc = self.doc
            if doc is None or self.target.store is None:
                raise InvalidInput("DCP load: read_data before read_metadata")
            tensors = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
            per_fqn: dict[str, int] = {}
            for item in plan.items:
                fqn = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    if fqn not in doc["bytes"]:
                        raise InvalidInput(f"DCP load: step {self.read_step} holds no value "
                                           f"{fqn!r}")
                    planner.load_bytes(item, io.BytesIO(doc["bytes"][fqn]))
                elif fqn not in doc["tensors"]:
                    raise InvalidInput(f"DCP load: step {self.read_step} holds no tensor {fqn!r}")
                else:
                    per_fqn[fqn] = per_fqn.get(fqn, 0) + 1
            for item in tensors:
                fqn = item.storage_index.fqn
                dest = planner.resolve_tensor(item).detach()
                target = self._direct(item, dest, doc) if per_fqn[fqn] == 1 else None
                if target is not None:
                    direct[fqn] = target
                else:
                    lo, hi = _rows(item)
                    a, b = spans.get(fqn, (lo, hi))
                    spans[fqn] = (min(a, lo), max(b, hi))
                copied.append((item, dest))
        except BaseException as exc:
            err = exc
        store = self.target.store
        if isinstance(store, DistributedStore):
            got = _read_pieces(store, self.read_step, direct, spans, err)
        else:
            if err is not None:
                raise err
            # Pieces of whole rows decode straight into their destination; the others
            # are read and copied.
            store.get_tables(self.read_step, out=direct)
            got = {} if not spans else store.get_tables(
                self.read_step, names=sorted(spans),
                rows={fqn: slice(lo, hi) for fqn, (lo, hi) in spans.items()})
        doc = self.doc
        assert doc is not None
        for item, dest in copied:
            fqn = item.storage_index.fqn
            if fqn in spans:
                size = doc["tensors"][fqn][1]
                lo, hi = _rows(item)
                first = spans[fqn][0]
                src = got[fqn][lo - first:hi - first]
                if not size:
                    src = src.reshape(())
                for dim in range(1, len(size)):
                    src = src.narrow(dim, int(item.storage_offsets[dim]), int(item.lengths[dim]))
                if dest.shape != src.shape:
                    raise InvalidInput(f"DCP load: {fqn!r}: the target's piece is "
                                       f"{tuple(dest.shape)}, the stored piece {tuple(src.shape)}")
                dest.copy_(src)
            planner.commit_tensor(item, dest)

    def _direct(self, item: ReadItem, dest: torch.Tensor, doc: dict) -> Any:
        """What ``get_tables(out=...)`` fills for ``item``, or None when it must be copied:
        the piece holds whole rows, in a contiguous CPU tensor of the stored dtype."""
        dtype, size, _, _ = doc["tensors"][item.storage_index.fqn]
        if not size or list(item.lengths[1:]) != list(size[1:]) or any(item.storage_offsets[1:]):
            return None
        if (not dest.is_contiguous() or dest.device.type != "cpu"
                or dtype_name(dest.dtype) != dtype or list(dest.shape) != list(item.lengths)):
            return None
        lo, hi = _rows(item)
        if isinstance(self.target.store, DistributedStore):
            return Shard(dest, row_offset=lo, rows=int(size[0]))
        return dest if (lo, hi) == (0, int(size[0])) else None


def _document(store: Any, step: int) -> tuple[dict | None, early.Locations | None]:
    """The DCP document of ``step`` of a plain store (the coordinator's), and where its
    tensors' blocks lie (early.py; None: nothing is hinted)."""
    doc = store.metadata(step).get(docmeta.KEY)
    if doc is None:
        return None, None
    return doc, early.locations(store.objects, step, doc["tensors"])


def _no_step() -> StepNotFound:
    return StepNotFound(-1, "DCP load: the store holds no step (step=None asks for the "
                            "latest)")


def _latest_document(store: Any, step: int | None
                     ) -> tuple[int | None, dict | None, early.Locations | None]:
    """``_document`` of ``step`` (None: the latest; None again where there is none) of
    the coordinator's plain store, with the step read."""
    if step is None:
        steps = store.steps()
        if not steps:
            return None, None, None
        step = steps[-1]
    return (step, *_document(store, step))


def _hint_source(store: Any) -> Any:
    """What this rank hints the blocks' records through: the coordinator's (or the one
    process's) own store, a rank's reader of the store's packs."""
    if not isinstance(store, DistributedStore):
        return store.objects
    if store.is_coordinator:
        return store.coordinator_store.objects
    return store.readers.source(("locs", None, []))


def _read_pieces(ds: DistributedStore, step: int | None, direct: dict[str, Shard],
                 spans: dict[str, tuple[int, int]], err: BaseException | None
                 ) -> dict[str, torch.Tensor]:
    """One collective read of a rank's pieces: the tables of ``direct`` decoded into their
    Shards (sharing blocks with other ranks' direct pieces), the rows ``spans`` of the
    others into fresh tensors (returned), all blocks in one pass of the pool. ``err``
    (this rank's plan failed) enters the request round, so every rank raises it there. A
    plan round of its own, then a read for each kind of piece, cost a cold load three
    rounds and a drained pool more."""
    def request() -> dict[str, Any]:
        if err is not None:
            raise err
        req: dict[str, Any] = {n: ("shared", [(d.row_offset, d.row_end,
                                               tuple(d.local.shape[1:]),
                                               dtype_name(d.local.dtype))])
                               for n, d in direct.items()}
        req.update({n: ("slice", (lo, hi, None)) for n, (lo, hi) in spans.items()})
        return req

    def read(loc: Located, report: Any) -> dict[str, torch.Tensor]:
        # One pass over every piece; a block whose rows another rank's direct pieces
        # share is read by one of the two (distributed/boundary.py).
        fresh = {n: new_output(tm, slice(*spans[n])) for n, (tm, _) in loc.tables.items()
                 if n not in direct}
        faults = Prefault(list(fresh.values()))  # fresh memory: faulted off the decoders
        try:
            fill_rows(ds, loc, [(n, 0, direct[n] if n in direct else Shard(
                fresh[n], row_offset=spans[n][0], rows=tm.node.rows))
                for n, (tm, _) in loc.tables.items()])
        finally:
            faults.stop()
        return fresh

    def once() -> dict[str, torch.Tensor]:
        return get(ds, step, "DCP load", request, read)

    with engine_errors():
        return transfer.again(ds, once)

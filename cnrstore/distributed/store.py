"""DistributedStore: one checkpoint store written and read by every rank of a process group
(docs/GUIDE.md, "Many ranks and object stores"; docs/ARCHITECTURE.md, "Many ranks").

The group's first rank is the coordinator: it alone opens the store's index (a plain
CheckpointStore at ``path``, with ``cache_dir`` for a bucket or a shared directory). The
other ranks never open an index nor touch a cache_dir: they reach the same packs through
the storage the coordinator names (its locator; a bucket's client is rebuilt on each rank
from its own AWS_* environment and ``storage_options``), write packs there and read
records by the locations the coordinator sends (cnrstore/distributed/transfer.py). Every
method is collective: every rank calls it, in the same order, and every rank returns the
same result or raises the same error. The store runs its collectives on gloo groups of
its own (one for the calling thread, one for the background writer), so they never
interleave with the training's collectives or with each other.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from cnrstore.codec.cores import thread_pool
from cnrstore.core.lifetime import close_at_exit
from cnrstore.core.options import Options, make_options
from cnrstore.core.progress import check_progress
from cnrstore.core.put import put
from cnrstore.core.snapshot import HostBuffers
from cnrstore.core.store import CheckpointStore
from cnrstore.core.store import open as open_plain
from cnrstore.core.writer import BackgroundWriter, StepInfo
from cnrstore.distributed import read, statestore, structure, transfer
from cnrstore.distributed.comm import Comm, coordinator_box, unbox
from cnrstore.distributed.commit import CoordinatorCommit
from cnrstore.distributed.put import RowGrid
from cnrstore.errors import CheckpointError, InvalidInput, translating
from engine import ProgressFn

__all__ = ["DistributedStore", "open_distributed"]

_DEFAULT_TIMEOUT = 300.0

_OPEN_ONLY = ("create", "compression_level", "readonly", "cache_dir", "storage_options")


class DistributedStore:
    """A checkpoint store shared by the ranks of a process group; open it with
    ``cnrstore.open(path, group=pg)``. Same methods as CheckpointStore, all collective."""

    def __init__(self, path: str | os.PathLike, options: Options | None, *, group: Any,
                 timeout: float = _DEFAULT_TIMEOUT,
                 first: Callable[[CheckpointStore], Any] | None = None, **kwargs: Any):
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidInput("cnrstore.open(group=...): torch.distributed is not "
                               "initialized (call dist.init_process_group first)")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidInput(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.path = os.fspath(path)
        ranks = dist.get_process_group_ranks(group)
        self.comm = Comm(ranks, float(timeout))      # the calling thread's collectives
        try:
            self.wcomm = Comm(ranks, float(timeout))  # the background writer's
        except BaseException:
            self.comm.close()
            raise
        self.local: CheckpointStore | None = None
        err: BaseException | None = None
        resolved = None
        self.storage: Any = None     # where the packs live, reached without the index
        self._staging: str | None = None
        if self.comm.coordinator:
            try:
                local = self.local = open_plain(path, options, **kwargs)
                self.storage = transfer.storage_of(local.objects)
                resolved = (local.options, transfer.locator(self.storage),
                            first and coordinator_box(1, lambda: first(local), scatter=False))
            except BaseException as exc:
                err = exc
        else:
            try:
                make_options(options, {k: v for k, v in kwargs.items()
                                       if k not in _OPEN_ONLY})
            except BaseException as exc:
                err = exc
        try:
            got = self.comm.agree(err, "open", resolved)
            err = None
            if not self.comm.coordinator:
                # Never the caller's cache_dir: only the coordinator has an index.
                try:
                    self.storage, self._staging = transfer.attach(
                        got[0][1], kwargs.get("storage_options"))
                except BaseException as exc:
                    err = exc
            self.comm.agree(err, "open: storage", None)
        except BaseException:
            if self.local is not None:
                self.local.close()
            transfer.detach(self.storage if self.local is None else None, self._staging)
            self.comm.close()
            self.wcomm.close()
            raise
        self._options: Options = got[0][0]
        self._first: Any = got[0][2]
        assert self.options.decode_threads is not None
        self.lock = threading.RLock()
        self.writer = BackgroundWriter(max_inflight=self.options.max_inflight)
        self.pool = thread_pool(self.options.decode_threads, "cnr-dist-decode")
        self.buffers = HostBuffers(keep=self.options.max_inflight + 1,
                                   max_bytes=self.options.host_buffer_bytes)
        self.states: dict[tuple[str, int], Any] = {}
        # Every rank's state skeleton at the last put_state, where no rank held a column
        # piece (the same on every rank): the next put_state's structure round is skipped
        # while each rank's stays the same (distributed/statestore.py).
        self.last_skeletons: list | None = None
        self.segments: dict[str, list] = {}      # coordinator's segment id cache per table
        self.pending: dict[int, Future] = {}
        self.last_root: str | None = None   # root of this rank's latest queued put
        self.closed = False
        # The put pipeline (core/put.py): its rounds, where the rows are planned, and
        # how the step is committed.
        self.group = self.comm
        self.placement = RowGrid()
        self.commit = CoordinatorCommit()
        # The get pipeline (core/get.py): the blocks each rank reads, located for it.
        self.reader = read.RankBlocks()
        self.shard_leaf = _shard_leaf()
        self.readers = transfer.Readers(self.storage)  # packs this rank reads by location
        close_at_exit(self)  # after the coordinator's plain store: closed before it

    # -- plumbing ------------------------------------------------------------------------
    @property
    def options(self) -> Options:
        """The store's options, as the coordinator resolved them (the same on every rank)."""
        return self._options

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world

    @property
    def is_coordinator(self) -> bool:
        return self.comm.coordinator

    def take_first(self) -> Any:
        """The open's ``first(coordinator's store)`` (its round carried it), or its error."""
        box, self._first = self._first, None
        return None if box is None else unbox(box)

    def check_open(self) -> None:
        if self.closed:
            raise CheckpointError("store is closed")

    def from_coordinator(self, comm: Comm, what: str, fn: Callable[[], Any], *,
                         scatter: bool = True) -> Any:
        """``fn()`` run on the coordinator (Comm.from_coordinator)."""
        return comm.from_coordinator(what, fn, scatter=scatter)

    def coordinated(self, what: str, fn: Callable[[CheckpointStore], Any], *,
                    check: Callable[[], Any] | None = None) -> Any:
        """Run ``fn(store)`` on the coordinator after every queued put, same result or
        error on every rank (``check()``'s error too, raised on a rank before)."""
        self.check_open()
        self.drain()
        err = None
        try:
            if check is not None:
                check()
        except BaseException as exc:
            err = exc
        # Every call begins with an all-gather, where ranks in different calls meet
        # (comm.py): a broadcast alone would pair this call with another's round.
        self.comm.agree(err, what)
        return self.from_coordinator(self.comm, what, lambda: fn(self.coordinator_store),
                                     scatter=False)

    @property
    def coordinator_store(self) -> CheckpointStore:
        """The coordinator's plain store (only the coordinator has one)."""
        if self.local is None:
            raise CheckpointError("only the coordinator opens the store's index")
        return self.local

    def drain(self) -> None:
        """Wait for this rank's queued puts (their rounds are collective: every rank's
        writer finishes them)."""
        self.writer.drain()

    # -- lifetime ------------------------------------------------------------------------
    @translating
    def close(self) -> None:
        """Wait for pending puts and close (collective unless a rank failed)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.writer.close()
        finally:
            self.pool.shutdown(wait=True)
            self.readers.close()
            if self.local is not None:
                self.local.close()
            else:
                transfer.detach(self.storage, self._staging)
            self.wcomm.close()
            self.comm.close()

    def __enter__(self) -> DistributedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- put -----------------------------------------------------------------------------
    @translating
    def put_tables(self, step: int, tables: Mapping, *, quant: Any = "exact",
                   metadata: Mapping | None = None, blocking: bool = True,
                   touched: Mapping | None = None,
                   progress: ProgressFn | None = None) -> StepInfo | Future:
        """Collective put. ``tables`` on each rank: name -> plain tensor (the whole table;
        given on several ranks it is replicated and stored once), ``cnrstore.Shard`` or a
        list of Shards (the rows this rank holds; all ranks' shards tile the table), or a
        DTensor/ShardedTensor. ``touched``: per table, GLOBAL row ids of this rank's own
        rows changed since the last put. ``step``, ``quant`` and ``metadata`` are the same
        on every rank. Every rank gets the same StepInfo (its own ``stall_seconds``) or
        the same error, and no step appears unless every rank's part was written.
        ``progress(done, total)`` on each rank hears of that rank's own work: the bytes
        of the blocks it encodes (its rows, with those other ranks sent it), the last call
        once the step committed (cnrstore/core/progress.py)."""
        return put(self, step, tables, quant=quant, metadata=metadata,
                        blocking=blocking, touched=touched, progress=progress)

    @translating
    def put_state(self, step: int, state: Any, *, quant: Any = None,
                  metadata: Mapping | None = None, blocking: bool = True,
                  touched: Mapping | None = None,
                  progress: ProgressFn | None = None) -> StepInfo | Future:
        """Collective put_state: tensor leaves may be plain (replicated, or given by one
        rank only: a table-wise table), Shards, DTensor or ShardedTensor. The structure
        stored names every rank's leaves (dict entries merged, in the order of the lowest
        rank that gives them); a Python leaf several ranks give is the lowest rank's; a
        path that is a tensor on one rank and something else on another is InvalidInput
        before anything is written. ``progress``: this rank's work, as for put_tables."""
        return statestore.put_state(self, step, state, quant=quant, metadata=metadata,
                                    blocking=blocking, touched=touched, progress=progress)

    # -- get -----------------------------------------------------------------------------
    @translating
    def get_tables(self, step: int | None = None, *, names: Iterable[str] | None = None,
                   rows: Mapping[str, slice] | None = None, device: Any = "cpu",
                   out: Mapping | None = None, progress: ProgressFn | None = None) -> dict:
        """Collective read; each rank asks for its own names and rows and reads only the
        blocks overlapping them. ``out`` values may be tensors (the whole table) or
        Shards (their rows, filled in place). ``progress(done, total)`` on each rank:
        the bytes that rank decodes."""
        return transfer.again(self, lambda: read.get_tables(
            self, step, names=names, rows=rows, device=device, out=out, progress=progress))

    @translating
    def get_state(self, step: int | None = None, *, device: Any = "cpu",
                  names: Iterable[str] | None = None,
                  progress: ProgressFn | None = None) -> Any:
        """Collective get_state; ``names`` as for CheckpointStore.get_state (each rank
        may pick its own); ``progress``: the bytes this rank decodes."""
        return transfer.again(self, lambda: statestore.get_state(
            self, step, device=device, names=names, progress=progress))

    @translating
    def load_state(self, step: int | None, state: Any, *, strict: bool = True,
                   names: Iterable[str] | None = None,
                   progress: ProgressFn | None = None) -> Any:
        """Restore into ``state`` in place: plain tensors get the whole table, Shards,
        DTensor and ShardedTensor leaves their own rows; an empty dict or list the step
        holds filled on every rank (a fresh Adam's ``"state": {}``) comes back filled,
        as in CheckpointStore.load_state. ``names`` as there; ``progress``: the bytes
        this rank restores in place."""
        return transfer.again(self, lambda: statestore.load_state(
            self, step, state, strict=strict, names=names, progress=progress))

    @translating
    def structure(self, state: Any, what: str, *, error: BaseException | None = None,
                  ask: Callable[[CheckpointStore], Any] | None = None) -> Any:
        """load_state's structure round (structure.py) on its own, ``ask(store)``'s answer
        from the coordinator (after the queued puts) and this rank's ``error`` riding it."""
        self.check_open()
        self.drain()
        return structure.agree(self, state, what, error, None, ask)

    @translating
    def load_agreed(self, step: int | None, state: Any, agreed: Any, *,
                    strict: bool = True) -> Any:
        """load_state of ``state`` as ``structure`` agreed it: no structure round."""
        return transfer.again(self, lambda: statestore.load_state(
            self, step, state, strict=strict, agreed=agreed))

    @translating
    def changes(self, a: int, b: int, names: Iterable[str] | None = None, *,
                rows: Mapping[str, slice] | None = None, strict: bool = False) -> Any:
        """Collective ``changes`` (CheckpointStore.changes): every rank asks for its own
        ``names`` and ``rows`` (e.g. the range it serves) of the same two steps, and reads
        them itself; all of a rank's changes are read before the call returns."""
        from cnrstore.distributed import changes as dchanges

        return dchanges.changes(self, a, b, names, rows=rows, strict=strict)

    @translating
    def metadata(self, step: int | None = None) -> dict:
        return self.coordinated("metadata", lambda s: s.metadata(step))

    # -- maintenance ---------------------------------------------------------------------
    @translating
    def steps(self) -> list[int]:
        return self.coordinated("steps", lambda s: s.steps())

    @translating
    def delete_step(self, step: int) -> None:
        return self.coordinated("delete_step", lambda s: s.delete_step(step))

    @translating
    def delete_steps(self, steps: Iterable[int]) -> list[int]:
        steps = list(steps) if not isinstance(steps, (str, bytes)) else steps
        return self.coordinated("delete_steps", lambda s: s.delete_steps(steps))

    @translating
    def rollback(self, step: int) -> list[int]:
        deleted = self.coordinated("rollback", lambda s: s.rollback(step))
        if deleted:  # the diff bases describe the rolled-back branch
            self.states.clear()
        return deleted

    @translating
    def gc(self, keep_last: int | None = None, keep: Iterable[int] = (), *,
           threshold: float = 0.25, progress: ProgressFn | None = None) -> Any:
        """Collective gc, run by the coordinator: its ``progress`` hears of the work (as
        for CheckpointStore.gc); the other ranks do none of it and hear nothing."""
        keep = list(keep) if not isinstance(keep, (str, bytes)) else keep
        report = self.coordinated("gc", lambda s: s.gc(
            keep_last, keep, threshold=threshold,
            progress=progress if self.is_coordinator else None),
            check=lambda: check_progress(progress))
        self._drop_missing()
        return report

    def _drop_missing(self) -> None:
        """After gc: forget base slots whose blocks are gone (written full next time)."""
        oids = sorted({s.oid for st in self.states.values() for s in st.slots
                       if s is not None and s.oid is not None})
        got = self.comm.all_gather(oids, "gc: bases")
        gone = self.from_coordinator(self.comm, "gc: bases", lambda: sorted(
            transfer.missing(self.coordinator_store.objects, sorted({o for g in got for o in g}))),
            scatter=False)
        if gone:
            gone_set = set(gone)
            for st in self.states.values():
                st.drop_missing(lambda oid: oid not in gone_set)

    @translating
    def verify(self, *, deep: bool = True, progress: ProgressFn | None = None) -> Any:
        """Collective verify, run by the coordinator; ``progress`` as for ``gc``."""
        return self.coordinated("verify", lambda s: s.verify(deep=deep, progress=progress),
                                check=lambda: check_progress(progress))

    @translating
    def stats(self) -> Any:
        return self.coordinated("stats", lambda s: s.stats())

    def __repr__(self) -> str:
        return (f"DistributedStore({self.path!r}, rank={self.rank}/{self.world_size}, "
                f"block_rows={self.options.rows})")


if TYPE_CHECKING:
    from cnrstore.core.api import StoreAPI

    def _is_store_api(store: DistributedStore) -> StoreAPI:
        """mypy checks here that DistributedStore has the shared store API (core/api.py)."""
        return store


def _shard_leaf() -> Callable[[Any], Any] | None:
    try:
        from cnrstore.distributed.leaves import shard_leaf
    except ImportError:
        return None
    return shard_leaf


@translating
def open_distributed(path: str | os.PathLike, options: Options | None = None, *, group: Any,
                     **kwargs: Any) -> DistributedStore:
    """Collective open (cnrstore.open with ``group``)."""
    return DistributedStore(path, options, group=group, **kwargs)

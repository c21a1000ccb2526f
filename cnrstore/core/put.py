"""The put pipeline, the one both handles run (CheckpointStore and DistributedStore
put_tables and put_state; docs/ARCHITECTURE.md, "A put and a get"; docs/MANIFEST.md,
"Write rules"; docs/design/one-pipeline.md):

1. ``placement.prepare``: check the input and decide which block runs this rank plans
   (a world of one: every table whole, core/placement.py; many ranks: the global row
   grid, boundary rows moved to their owners, cnrstore/distributed/put.py);
2. the diff base of each run: the handle's own, else seeded from the store
   (``placement.seed``; the reading is core/seed.py's at any world size);
3. ``plan_table`` on every run (the stall), then the ranks agree on each table's row
   width (a world of one agrees with itself);
4. ``commit.job``: the step, queued on the handle's writer thread (a world of one writes
   through the engine writer, core/commit.py; many ranks through the coordinator,
   cnrstore/distributed/commit.py);
5. wait (a blocking put), and plan again keeping full codes when a gc in another process
   swept the base under the writer lock (``BaseGone``, only the engine writer raises it).

The rounds among ranks are the handle's ``group`` (core/group.py). The queued-put
bookkeeping is kept here for both: a handle keeps ``pending`` (each queued step's Future),
``states`` (the diff bases the queued puts leave, keyed by ``Work.key``: a table name,
or (table, first block) on a rank; a failed put's are put back, ``forget_failed``). A
new step must be neither pending nor stored, and not below the highest stored or
pending step (lineage.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from cnrstore.core.progress import Reporter
from cnrstore.core.snapshot import TablePlan, plan_table
from cnrstore.core.tablestate import PutOutcome, TableState
from cnrstore.core.writer import BaseGone, StepInfo
from cnrstore.errors import NonFiniteValues, StepExists, StepOrderError, ValueOutOfRange
from cnrstore.format.load import list_steps
from cnrstore.format.manifest import root_name
from engine import ObjectStore

__all__ = ["Commit", "Placement", "PutBook", "RankStructure", "Request", "Work", "check_new_step",
           "forget_failed", "marking_failed", "put", "queued"]

T = TypeVar("T")
Plans = list[tuple[str, int, TablePlan]]   # (table, first block, plan)


@dataclass
class Work:
    """One run of blocks this rank plans: blocks ``[b0, b1)`` of table ``name``, from
    global row ``lo``, its diff base kept under ``key`` in the handle's ``states``. The
    rows are ``table`` (the caller's tensor), or ``assemble()`` (a copy assembled from a
    rank's parts, made when planned); ``touched`` the changed rows relative to ``lo``
    (None: unknown)."""

    name: str
    key: Any
    b0: int
    b1: int
    lo: int
    nbytes: int
    table: torch.Tensor | None
    assemble: Callable[[], torch.Tensor] | None = None
    touched: torch.Tensor | None = None

    def rows(self) -> torch.Tensor:
        if self.table is not None:
            return self.table
        assert self.assemble is not None
        return self.assemble()


@dataclass
class Request:
    """A checked put: the runs this rank plans, each table's scheme, the metadata
    document, ``tables`` (what the placement keeps of each table: the tensor, or a
    rank's GlobalTable) and when the caller's stall began."""

    works: list[Work]
    schemes: dict[str, str]
    meta_doc: dict
    tables: dict[str, Any]
    t0: float
    extra: Any = None            # what else the placement keeps of the put
    bases: dict[Any, TableState | None] = field(default_factory=dict)
    damaged: frozenset[bytes] = frozenset()  # unreadable records of the bases seeded
    state: dict | None = None    # the structure the ranks agreed (from a RankStructure)
    # This rank's failure after the placement's last round: raised in the width round,
    # which every rank enters, so every rank raises it (distributed/put.py).
    error: BaseException | None = None
    # Gives back the placement's scratch buffers (the rows it assembled runs from), once
    # every run is planned: a plan keeps copies, never these (distributed/put.py).
    release: Callable[[], None] | None = None
    step: int = 0                # the step put (set by ``put``)


@dataclass
class RankStructure:
    """A put_state's structure as this rank flattened it, or the error flattening failed
    with: the placement carries it on its check round and merges every rank's there
    (``Request.state``), so it takes no round of its own."""

    doc: dict | None
    error: BaseException | None = None
    # None: the state's structure was agreed in a round before the put. True: it was taken
    # from the handle's last put_state, this rank's unchanged; False: this rank's changed.
    # Every rank's flag rides the check round: where one is False, every rank raises
    # Restructure after it, and put_state runs the structure round (distributed/put.py).
    cached: bool | None = None


class Placement(Protocol):
    """Where the rows of a put are planned (core/placement.py, distributed/put.py)."""

    def prepare(self, h: Any, step: int, tables: Mapping, *, quant: Any,
                metadata: Mapping | None, touched: Mapping | None, state: dict | None,
                progress: Any) -> Request: ...

    def bases(self, h: Any, req: Request) -> dict[Any, TableState | None]:
        """The diff base of every run, by its key: the handle's own, else
        (``seed_from_store``) the newest stored version's (core/seed.py), else None
        (written full)."""
        ...


class Commit(Protocol):
    """How a planned step reaches the store (core/commit.py, distributed/commit.py)."""

    def known_widths(self, h: Any, req: Request) -> dict[str, int] | None:
        """Every table's row width where it is known before planning (no intN table) and
        a rank's planning error may reach the other ranks on the writer's first round
        (``job(..., error=)``): the put then takes no width round, and its caller returns
        once its own runs are planned, without waiting for the slowest rank's (many
        ranks, issue 26). None: the ranks agree the widths (``_agree_widths``)."""
        ...

    def plan_options(self, h: Any, req: Request, *, blocking: bool, keep_full: bool
                     ) -> list[dict]:
        """plan_table's options for each run of ``req`` (its base in ``req.bases``)."""
        ...

    def job(self, h: Any, step: int, req: Request, plans: Plans, widths: dict[str, int],
            stall: float, state: dict | None, error: BaseException | None = None
            ) -> Callable[[], StepInfo]:
        """The step's write, for the writer thread; ``error`` (only where ``known_widths``
        gave widths): this rank's planning failed, and the job fails the step on every
        rank with it."""
        ...


def put(h: Any, step: int, tables: Mapping, *, quant: Any, metadata: Mapping | None,
        blocking: bool, touched: Mapping | None, state: Any = None,
        keep_full: bool = False, progress: Any = None,
        report: Reporter | None = None) -> StepInfo | Future:
    """Put ``tables`` as ``step`` through handle ``h`` (its ``group``, ``placement`` and
    ``commit``, its writer and the PutBook of its queued puts)."""
    place: Placement = h.placement
    commit: Commit = h.commit
    with h.lock:
        h.check_open()
        req = place.prepare(h, step, tables, quant=quant, metadata=metadata,
                            touched=touched, state=state, progress=progress)
        req.step = step
        if report is None:  # a put planned again (below) goes on from where it was
            # This rank's own work: the bytes of the runs it plans; done == total once
            # the step committed.
            report = Reporter(progress, sum(w.nbytes for w in req.works),
                              min_total=h.options.progress_min_bytes)
        failed: BaseException | None = None
        try:
            req.bases = place.bases(h, req)
            options = commit.plan_options(h, req, blocking=blocking, keep_full=keep_full)
            known = commit.known_widths(h, req)
            plans, failed = _plan_all(h, req, options, report, known)
            widths = _agree_widths(h, req, plans, known)
        finally:
            if req.release is not None:
                req.release()
        job = commit.job(h, step, req, plans, widths, time.perf_counter() - req.t0,
                         req.state if req.state is not None else state, error=failed)
        fut: Future = Future()
        outcome = PutOutcome([p.state for _, _, p in plans])
        try:
            h.writer.submit(lambda: marking_failed(outcome, job), future=fut,
                            cleanup=lambda: _release(plans))
        except BaseException:
            for p in _plans(plans):  # the caller does not wait: a borrowed table is not read
                if p.borrowed is not None:
                    p.borrowed.set()
            if not h.writer.queued(fut):
                # Not queued (e.g. Ctrl-C while waiting for a writer slot): as for a
                # refused put, the diff bases stay those of the last put.
                _release(plans)
                raise
            _queued(h, step, req, plans, fut)  # interrupted just after: it will be written
            raise
        _queued(h, step, req, plans, fut)
    if failed is not None and not isinstance(failed, Exception):
        raise failed  # Ctrl-C in planning: queued to fail every rank's put, then raised
    if not blocking:
        fut.add_done_callback(lambda f: None if f.exception() else report.finish())
        return fut
    try:
        for p in _plans(plans):  # on this thread, while the writer thread writes
            if p.fingerprint_later is not None:
                p.fingerprint_later()
        info = fut.result()
        report.finish()
        return info
    except BaseGone:
        if keep_full:
            raise
    finally:
        # Plans that borrow the caller's tables: from here on the caller may change them
        # (an interrupted wait, too), so the writer must not commit what it reads now.
        for p in _plans(plans):
            if p.borrowed is not None:
                p.borrowed.set()
    # A gc in another process swept the base this put diffed against. The caller's tables
    # are still as they were (the put blocks), so plan it again, keeping every row's codes:
    # blocks whose base is gone are then written in full. ``touched`` is dropped: the
    # failure cleared the bases it was relative to.
    return put(h, step, tables, quant=quant, metadata=metadata, blocking=True,
               touched=None, state=state, keep_full=True, report=report)


def _plan_all(h: Any, req: Request, options: list[dict], report: Reporter,
              known: dict[str, int] | None) -> tuple[Plans, BaseException | None]:
    """Plan every run against its diff base: (the plans, None). A rank whose planning
    failed enters the ranks' width round with its error, so every rank raises it; where
    the widths are ``known`` (``Commit.known_widths``) there is no width round: (no
    plans, the error), which the step's job raises on every rank's writer round, so
    every rank's put fails (the Future of a non-blocking one)."""
    plans: Plans = []
    try:
        if req.error is not None:
            raise req.error
        for w, kwargs in zip(req.works, options):
            p = _plan(h, req, w, w.rows(), req.bases.get(w.key), w.touched, None, kwargs)
            plans.append((w.name, w.b0, p))
            if known is not None and p.state.row_nbytes != known[w.name]:
                raise AssertionError(f"put_tables: table {w.name!r} planned "
                                     f"{p.state.row_nbytes} bytes a row, its scheme "
                                     f"{known[w.name]} (a bug: report it)")
            report.add(w.nbytes)
    except BaseException as exc:
        _release(plans)
        if known is not None:
            return [], exc
        h.group.agree(exc, "put_tables: encode", {})
        raise
    return plans, None


def _plan(h: Any, req: Request, w: Work, rows: torch.Tensor, base: TableState | None,
          touched: torch.Tensor | None, wide: bool | None, kwargs: dict) -> TablePlan:
    opt = h.options
    try:
        return plan_table(w.name, rows, scheme=req.schemes[w.name], base=base, wide=wide,
                          block_rows=opt.rows, fanout=opt.segment_fanout,
                          max_chain=opt.max_chain, block_offset=w.b0, touched=touched,
                          buffers=h.buffers, layout=opt.block_layout, step=req.step,
                          **kwargs)
    except (NonFiniteValues, ValueOutOfRange) as exc:
        if not w.lo:
            raise
        raise type(exc)(exc.table, exc.row + w.lo, exc.scheme) from None  # the global row


def _agree_widths(h: Any, req: Request, plans: Plans, known: dict[str, int] | None
                  ) -> dict[str, int]:
    """Every table's row width on every rank: a rank's part of a table that needed wide
    qparams makes the whole table wide, as in a single-process put (docs/QUANTIZATION.md
    "Wide rows"); the parts planned narrow are planned again, locally. ``known``: the
    widths, known before planning (no round)."""
    if known is not None:
        return known
    group = h.group
    rnb = {n: p.state.row_nbytes for n, _, p in plans}
    try:
        got = group.agree(None, "put_tables: encode", rnb)
    except BaseException:
        _release(plans)
        raise
    if len(got) == 1:
        return rnb  # a world of one agrees with itself
    agreed = {n: max(g[n] for g in got if n in g) for n in req.tables
              if any(n in g for g in got)}
    if any(g[n] != agreed[n] for g in got for n in g):
        err = None
        try:
            works = {(w.name, w.b0): w for w in req.works}
            for i, (n, b0, p) in enumerate(plans):
                if p.state.row_nbytes != agreed[n]:
                    if p.release:
                        p.release()
                        p.release = None
                    w = works[(n, b0)]
                    plans[i] = (n, b0, _plan(h, req, w, w.rows(), req.bases.get(w.key),
                                             None, True, {}))
        except BaseException as exc:
            err = exc
        try:
            group.agree(err, "put_tables: encode wide", None)
        except BaseException:
            _release(plans)
            raise
    return agreed


def _plans(plans: Plans) -> Iterable[TablePlan]:
    return (p for _, _, p in plans)


def _release(plans: Plans) -> None:
    for _, _, p in plans:
        if p.release:
            p.release()
            p.release = None


def _queued(h: Any, step: int, req: Request, plans: Plans, fut: Future) -> None:
    # The next put diffs against this one (a Ctrl-C while the caller waits leaves it to
    # finish), unless this rank's planning failed: it fails everywhere, bases kept.
    h.last_root = root_name(step)
    ok = len(plans) == len(req.works)
    queued(h, step, fut, {w.key: p.state for w, (_, _, p) in zip(req.works, plans)},
           req.tables if ok else ())


class PutBook(Protocol):
    """What a handle keeps of its queued puts (HandleState, DistributedStore)."""

    states: dict[Any, Any]
    pending: dict[int, Future]


def check_new_step(objects: ObjectStore, pending: Mapping[int, Future], step: int) -> None:
    """StepExists for a step pending or stored, StepOrderError for one below the highest
    (with the handle's lock held: pending puts are part of the order)."""
    if step in pending or objects.root(root_name(step)) is not None:
        raise StepExists(step)
    known = list_steps(objects)  # the order rule: core/lineage.py says why
    highest = max([*known[-1:], *pending], default=None)
    if highest is not None and step < highest:
        raise StepOrderError(step, highest)


def forget_failed(book: PutBook, has: Callable[[bytes], bool] | None = None) -> None:
    """Before planning a put: a base left by a put that failed, or planned on one, is put
    back as the last committed put left it, else dropped (seeded again). ``has`` (a world
    of one): forget the put-back slots whose blocks the store lacks."""
    for key, state in list(book.states.items()):
        back = state.trusted()
        if back is None:
            del book.states[key]
        elif back is not state:
            book.states[key] = back
            if has is not None:
                back.drop_missing(has)


def marking_failed(outcome: PutOutcome, write: Callable[[], T]) -> T:
    """``write()`` on the writer thread; its outcome (set before its Future is done)
    says whether the bases it leaves are trusted."""
    try:
        info = write()
    except BaseException:
        outcome.settle(False)
        raise
    outcome.settle(True)
    return info


def queued(book: PutBook, step: int, fut: Future, states: Mapping[Any, Any],
           tables: Iterable[str] = ()) -> None:
    """The put of ``step`` is queued (also when the caller was interrupted just after):
    the next put diffs against the bases it leaves, ``states`` (key -> TableState). Every
    older base of those tables and of ``tables`` is forgotten (a rank's blocks of a table
    change owner with the shards; a rank may hold none of a table this time). The step
    stays pending until its Future is done."""
    tables = {*tables, *(_table(k) for k in states)}
    for key in [k for k in book.states if _table(k) in tables]:
        del book.states[key]
    for key, state in states.items():
        book.states[key] = state
        state.planned_root = root_name(step)
    book.pending[step] = fut

    def done(_: Future) -> None:
        book.pending.pop(step, None)

    fut.add_done_callback(done)


def _table(key: Any) -> str:
    return key if isinstance(key, str) else key[0]

"""The put path of a store handle: validate, plan every table against its diff base, and
queue the step on the handle's writer (docs/GUIDE.md, "The API contract"; docs/MANIFEST.md, "Write
rules"). ``put`` is CheckpointStore.put_tables and put_state.

The step checks and the queued-put bookkeeping here are the distributed put's too
(cnrstore/distributed/put.py): a handle keeps ``pending`` (each queued step's Future),
``states`` (the diff bases the queued puts leave, keyed by table name, or by (table,
first block) on a rank, which holds the bases of its own blocks) and ``failed`` (a
background put failed, so the bases cannot be trusted). A new step must be neither
pending nor stored, and not below the highest stored or pending step (lineage.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from cnrstore.core import lineage
from cnrstore.core.handle import HandleState
from cnrstore.core.options import ensure_stored
from cnrstore.core.progress import Reporter, check_progress
from cnrstore.core.seed import seed_state
from cnrstore.core.snapshot import TablePlan, plan_table
from cnrstore.core.tablestate import TableState
from cnrstore.core.validate import (
    check_step,
    check_tables,
    check_touched,
    check_writable,
    pack_metadata,
    resolve_quant,
)
from cnrstore.core.writer import BaseGone, StepInfo, write_step
from cnrstore.errors import StepExists, StepOrderError, WriteFailed
from cnrstore.format.load import list_steps
from cnrstore.format.manifest import check_step_fits, root_name
from engine import ObjectStore

__all__ = ["PutBook", "check_new_step", "forget_failed", "marking_failed", "put", "queued"]

T = TypeVar("T")


def put(core: HandleState, step: int, tables: Mapping, *, quant: Any, metadata: Mapping | None,
        blocking: bool, touched: Mapping | None, state: dict | None = None,
        keep_full: bool = False, progress: Any = None,
        report: Reporter | None = None) -> StepInfo | Future:
    core.check_open()
    check_writable(core.objects, "put_tables")
    check_step(step)
    check_tables(tables)
    check_progress(progress)
    opt = core.options
    schemes = resolve_quant(quant, tables, expected_restores=opt.expected_restores)
    meta_doc = pack_metadata(metadata)
    check_step_fits(step, list(tables), meta_doc, state)  # docs/MANIFEST.md "Memory caps"
    rows_touched = check_touched(touched, tables)
    with core.lock:
        core.check_open()
        forget_failed(core)
        check_new_step(core.objects, core.pending, step)
        # bytes of the tables planned; done == total once the step committed
        if report is None:  # a put planned again (below) goes on from where it was
            report = Reporter(progress, sum(t.numel() * t.element_size()
                                            for t in tables.values()),
                              min_total=opt.progress_min_bytes)
        t0 = time.perf_counter()
        plans: list[TablePlan] = []
        try:
            roots: dict[str, bytes | None] = {}

            def root(name: str) -> bytes | None:  # one lookup per anchor step per put
                if name not in roots:
                    roots[name] = core.objects.root(name)
                return roots[name]

            newest: list[str] = []

            def at_risk(base: TableState | None) -> bool:
                # A base on a step that will not be the newest when this put is written
                # may be dropped by another process's gc before the writer holds the
                # lock (issue 8); a base on a pending put has no anchor yet.
                if base is None:
                    return False
                if keep_full:
                    return True
                anchor = base.anchor[0] if base.anchor else base.planned_root
                # Even this handle's latest put is checked: another process may have put
                # a newer step since, and a gc keeping that one drops ours (issue 8).
                if not newest:
                    steps = list_steps(core.objects) + list(core.pending)
                    newest.append(root_name(max(steps)) if steps else "")
                return anchor != newest[0]

            for name, table in tables.items():
                base = core.states.get(name)
                if base is not None:
                    base.revalidate(root, core.objects.has)
                elif opt.seed_from_store:
                    # Diff base of a table's first put in this handle: the newest stored
                    # step that holds it with the same geometry and encoding.
                    core.writer.drain()
                    base = seed_state(core.objects, name, table, schemes[name],
                                      block_rows=opt.rows, fanout=opt.segment_fanout,
                                      pool=core.pool)
                plans.append(
                    plan_table(
                        name,
                        table,
                        scheme=schemes[name],
                        base=base,
                        block_rows=opt.rows,
                        fanout=opt.segment_fanout,
                        max_chain=opt.max_chain,
                        touched=rows_touched.get(name),
                        buffers=core.buffers,
                        keep_full=at_risk(base),
                        borrow=blocking,
                        defer_encode=not blocking,
                    )
                )
                report.add(table.numel() * table.element_size())
        except BaseException:
            _release(plans)
            raise
        stall = time.perf_counter() - t0
        fut: Future = Future()
        try:
            core.writer.submit(
                lambda: _write(core, step, plans, meta_doc, stall, state),
                cleanup=lambda: _release(plans),
                future=fut,
            )
        except BaseException:
            for p in plans:  # the caller does not wait: a borrowed table is not read
                if p.borrowed is not None:
                    p.borrowed.set()
            if not core.writer.queued(fut):
                # Not queued (e.g. Ctrl-C while waiting for a writer slot): as for a
                # refused put, the diff bases stay those of the last put.
                _release(plans)
                raise
            _queued(core, step, plans, fut)  # interrupted just after: it will be written
            raise
        _queued(core, step, plans, fut)
    if not blocking:
        fut.add_done_callback(lambda f: None if f.exception() else report.finish())
        return fut
    try:
        for p in plans:  # on this thread, while the writer thread writes
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
        for p in plans:
            if p.borrowed is not None:
                p.borrowed.set()
    # A gc in another process swept the base this put diffed against. The caller's tables
    # are still as they were (the put blocks), so plan it again, keeping every row's codes:
    # blocks whose base is gone are then written in full. ``touched`` is dropped: the
    # failure cleared the bases it was relative to.
    return put(core, step, tables, quant=quant, metadata=metadata, blocking=True,
               touched=None, state=state, keep_full=True, report=report)


def _release(plans: list[TablePlan]) -> None:
    for p in plans:
        if p.release:
            p.release()


def _queued(core: HandleState, step: int, plans: list[TablePlan], fut: Future) -> None:
    # The step will be written, so the next put diffs against it. A Ctrl-C while the
    # caller waits leaves it to finish; steps() tells whether it committed. A diff base
    # left on an older committed step stays correct (its blocks exist), only larger.
    core.last_root = root_name(step)
    queued(core, step, fut, {p.name: p.state for p in plans})


def _write(core: HandleState, step: int, plans: list[TablePlan], metadata: dict, stall: float,
           state: dict | None) -> StepInfo:
    order = lineage.commit_check(core.objects, step)

    def check(w) -> None:  # under the engine's writer lock, in the step's transaction
        order()
        ensure_stored(core.objects, w, core.options)

    try:
        def write() -> StepInfo:
            for p in plans:  # a non-blocking put's deferred encodes, before the writer lock
                p.encoded()
            return write_step(core.objects, step, plans, metadata=metadata,
                              stall_seconds=stall, lock_timeout=core.options.lock_timeout,
                              state=state, check=check)
        return marking_failed(core, write)
    except BaseException as exc:
        if isinstance(exc, (WriteFailed, StepOrderError, StepExists)):
            raise
        raise WriteFailed(step, f"{type(exc).__name__}: {exc}") from exc


class PutBook(Protocol):
    """What a handle keeps of its queued puts (HandleState, DistributedStore)."""

    states: dict[Any, Any]
    pending: dict[int, Future]
    failed: bool


def check_new_step(objects: ObjectStore, pending: Mapping[int, Future], step: int) -> None:
    """StepExists for a step pending or stored, StepOrderError for one below the highest
    (with the handle's lock held: pending puts are part of the order)."""
    if step in pending or objects.root(root_name(step)) is not None:
        raise StepExists(step)
    known = list_steps(objects)  # the order rule: core/lineage.py says why
    highest = max([*known[-1:], *pending], default=None)
    if highest is not None and step < highest:
        raise StepOrderError(step, highest)


def forget_failed(book: PutBook) -> None:
    """Before planning a put: a background put failed, so its diff bases are not trusted
    (the put writes every block full)."""
    if book.failed:
        book.states.clear()
        book.failed = False


def marking_failed(book: PutBook, write: Callable[[], T]) -> T:
    """``write()`` on the writer thread; its failure marks the bases untrusted."""
    try:
        return write()
    except BaseException:
        book.failed = True
        raise


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

"""The maintenance side of CheckpointStore: metadata, delete_step, gc, verify, stats, and
their report types (the get pipeline is get.py). Functions take the handle's
HandleState; writes (delete, gc) run on its writer thread, after every put queued before
them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cnrstore.core.handle import HandleState
from cnrstore.core.progress import Reporter, check_progress
from cnrstore.core.retention import check_retention, kept_steps
from cnrstore.core.validate import check_step
from cnrstore.core.verify import StepProblem, verify_objects
from cnrstore.errors import InvalidInput, StepNotFound
from cnrstore.format.load import list_steps, load_step
from cnrstore.format.manifest import root_name
from engine import Problem
from engine import StoreGCReport as EngineGCReport
from engine import StoreVerifyReport as EngineVerifyReport

__all__ = ["GCReport", "VerifyReport", "StoreStats"]


@dataclass(frozen=True)
class GCReport:
    """What ``CheckpointStore.gc`` dropped and reclaimed (bytes are allocated disk bytes)."""

    steps_deleted: tuple[int, ...]
    steps_kept: tuple[int, ...]
    objects_live: int
    objects_freed: int
    bytes_freed: int
    packs_rewritten: int
    packs_deleted: int


@dataclass(frozen=True)
class VerifyReport:
    """Result of ``CheckpointStore.verify``: ``ok`` and one message per problem found in
    the engine (missing/corrupt objects) or the manifest (undecodable nodes or blocks). The
same check as ``cnrstore verify`` (cnrstore/core/verify.py)."""

    ok: bool
    problems: tuple[str, ...]  # "what: message" of each record
    steps_checked: int
    blocks_checked: int
    engine: EngineVerifyReport | None = None
    records: tuple[Problem, ...] = ()  # the problems as records (StepProblem: step, table, block)


@dataclass(frozen=True)
class StoreStats:
    """Sizes of a store: what the kept steps hold logically vs what is stored."""

    steps: int
    logical_bytes: int      # sum of the put tables' sizes over the kept steps
    stored_bytes: int       # bytes the engine holds (allocated on disk for a pack store)
    objects: int
    dedup_ratio: float      # logical / stored


def metadata(core: HandleState, step: int | None) -> dict:
    core.check_open()
    return core.latest(step, lambda s: dict(load_step(core.objects, core.resolve_step(s))[1]
                                            .metadata))


def delete_step(core: HandleState, step: int) -> None:
    core.check_open()
    check_step(step)
    with core.lock:
        core.wait_step(step)

        def job() -> None:
            with core.objects.writer(timeout=core.options.lock_timeout) as w:
                if core.objects.root(root_name(step)) is None:
                    raise StepNotFound(step)
                w.delete_root(root_name(step))

        core.writer.run(job)


def _store_reporter(core: HandleState, progress: Any) -> Reporter:
    """A reporter of gc or verify, in thousandths, over the threshold by the store's
    stored bytes (what either pass reads)."""
    if check_progress(progress) is None:
        return Reporter(None, 0, min_total=0)
    size = core.objects.stats().stored_bytes
    return Reporter(progress, 1000 if size >= core.options.progress_min_bytes else 0,
                    min_total=1)


def gc(core: HandleState, keep_last: int | None, keep: Iterable[int], *,
       threshold: float, progress: Any = None) -> GCReport:
    core.check_open()
    keep_last, keep = check_retention(keep_last, keep)
    report = _store_reporter(core, progress)
    if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise InvalidInput(f"threshold must be in [0, 1], got {threshold!r}")

    def job() -> GCReport:
        # The steps are listed under the writer lock: listed before it, another process's
        # delete, rollback or gc could drop one first and this gc then failed on the missing
        # root (or kept by a stale rule). A writer that drops nothing commits nothing.
        with core.objects.writer(timeout=core.options.lock_timeout) as w:
            steps = list_steps(core.objects)
            kept = set(kept_steps(steps, keep_last=keep_last, keep=keep))
            dropped = [s for s in steps if s not in kept]
            for s in dropped:
                w.delete_root(root_name(s))
        rep: EngineGCReport = core.objects.gc(
            threshold=threshold, timeout=core.options.lock_timeout,
            progress=report.phase(0, 1) if report.fn is not None else None,
        )
        return GCReport(
            steps_deleted=tuple(dropped),
            steps_kept=tuple(sorted(kept)),
            objects_live=rep.objects_live,
            objects_freed=rep.objects_freed,
            bytes_freed=rep.bytes_freed,
            packs_rewritten=rep.packs_rewritten,
            packs_deleted=rep.packs_deleted,
        )

    with core.lock:
        result = core.writer.run(job)
        # Blocks of dropped steps may be gone: the diff base must not refer to them.
        for state in core.states.values():
            state.drop_missing(core.objects.has)
    report.finish()
    return result


def verify(core: HandleState, *, deep: bool, progress: Any = None) -> VerifyReport:
    core.check_open()
    report = _store_reporter(core, progress)
    core.writer.drain()
    r = verify_objects(core.objects, deep=deep, progress=_phases(report, deep))
    report.finish()
    eng = EngineVerifyReport(not any(not isinstance(p, StepProblem) for p in r.problems),
                             tuple(p for p in r.problems if not isinstance(p, StepProblem)),
                             r.objects_checked, r.bytes_checked)
    return VerifyReport(r.ok, tuple(f"{p.what}: {p.message}" for p in r.problems),
                        r.steps_checked, r.blocks_checked, eng, r.problems)


def _phases(report: Reporter, deep: bool) -> Any:
    """verify_objects' progress: the engine's pass, then (deep) the blocks', as halves."""
    if report.fn is None:
        return None
    engine_pass, blocks = report.phase(0, 1 + deep), report.phase(1, 2)
    in_blocks = [False]

    def tick(done: int, total: int) -> None:
        # the engine's pass ends with done == total; the block pass follows
        if in_blocks[0]:
            blocks(done, total)
        else:
            engine_pass(done, total)
            in_blocks[0] = done >= total
    return tick


def stats(core: HandleState) -> StoreStats:
    core.check_open()
    core.writer.drain()
    objects = core.objects
    steps = list_steps(objects)
    logical = sum(load_step(objects, s)[1].logical_bytes for s in steps)
    st = objects.stats()
    stored = st.stored_bytes or st.logical_bytes  # the memory twin allocates no disk
    ratio = logical / stored if stored else 0.0
    return StoreStats(len(steps), logical, stored, st.objects, ratio)

"""The read and maintenance side of CheckpointStore: get_tables, delete_step, gc, verify,
stats, and their report types. Functions take the store handle; writes (delete, gc) run on
its writer thread, after every put queued before them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from cnrstore.core.restore import check_slice, read_table
from cnrstore.core.retention import check_retention, kept_steps
from cnrstore.core.tablestate import TableState
from cnrstore.core.validate import check_device, check_step
from cnrstore.errors import (
    CheckpointError,
    InvalidInput,
    InvalidType,
    StepNotFound,
    TableNotFound,
)
from cnrstore.format.blocks import resolve
from cnrstore.format.manifest import list_steps, load_manifest, load_step, root_name
from engine import GCReport as EngineGCReport
from engine import StoreError
from engine import VerifyReport as EngineVerifyReport

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
    the engine (missing/corrupt objects) or the manifest (undecodable nodes or blocks)."""

    ok: bool
    problems: tuple[str, ...]
    steps_checked: int
    blocks_checked: int
    engine: EngineVerifyReport | None = None


@dataclass(frozen=True)
class StoreStats:
    """Sizes of a store: what the kept steps hold logically vs what is stored."""

    steps: int
    logical_bytes: int      # sum of the put tables' sizes over the kept steps
    stored_bytes: int       # bytes the engine holds (allocated on disk for a pack store)
    objects: int
    dedup_ratio: float      # logical / stored


def _resolve_step(store, step) -> int:
    """``step`` itself once it is written, or the highest step when None."""
    if step is None:
        store._writer.drain()
        steps = list_steps(store._objects)
        if not steps:
            raise StepNotFound(-1, "the store holds no steps")
        return steps[-1]
    check_step(step)
    store._wait_step(step)
    return step


def latest(store, step, fn):
    """``fn(step)``; with ``step`` None, ``fn(highest step)``, resolved again when another
    handle or process deleted that step (rollback, gc) between resolving and reading it."""
    if step is not None:
        return fn(step)
    for attempt in range(16):
        resolved = _resolve_step(store, None)
        try:
            return fn(resolved)
        except StepNotFound as exc:
            if exc.step != resolved or attempt == 15:
                raise


def metadata(store, step) -> dict:
    store._check_open()
    if step is None:
        return latest(store, None, lambda s: metadata(store, s))
    return dict(load_step(store._objects, _resolve_step(store, step))[1].metadata)


def get_tables(store, step, *, names, rows, device) -> dict:
    store._check_open()
    if step is None:
        return latest(store, None, lambda s: get_tables(store, s, names=names, rows=rows,
                                                           device=device))
    if names is not None:
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise InvalidType("names must be an iterable of table names (not a str)")
        names = list(names)
    if rows is not None and not isinstance(rows, Mapping):
        raise InvalidType("rows must be a mapping table name -> slice")
    rows = dict(rows or {})
    device = check_device(device)
    step = _resolve_step(store, step)
    try:
        return _read_step(store, step, names, rows, device)
    except StoreError as exc:
        # Another handle or process deleted the step and a gc swept its objects while they
        # were read: the step is gone, not damaged (the engine's ObjectNotFound escaped).
        if not _still_there(store._objects, step):
            raise StepNotFound(step, f"step {step} was deleted while it was read") from exc
        raise


def _read_step(store, step: int, names, rows: dict, device) -> dict:
    manifest = load_manifest(store._objects, step, names=names)
    for name, sel in rows.items():
        if name not in manifest.tables:
            raise TableNotFound(name, step)
        check_slice(sel, manifest.tables[name].node.rows, name=name)
    out = {}
    for name, tm in manifest.tables.items():
        whole = rows.get(name) is None
        with store._lock:
            seed = whole and name not in store._states and not store._closed
        lossy = tm.node.scheme != "exact"
        tensor, codes, fps = read_table(
            store._objects, tm, store._pool, rows=rows.get(name),
            keep_codes=seed and lossy, fingerprints=seed and not lossy,
        )
        if seed:
            _seed(store, name, tm, fps, codes, (root_name(step), manifest.oid))
        out[name] = tensor.to(device)
    return out


def _seed(store, name, tm, fps, codes, anchor) -> None:
    """Seed the diff base of a table this handle has no base of (DESIGN.md: a restarted
    job's next put is incremental again; a table the handle put keeps its base)."""
    if codes is not None:
        state = TableState.from_manifest(tm, seed_codes=torch.from_numpy(codes), anchor=anchor)
    else:
        state = TableState.from_manifest(tm, fingerprints=fps, anchor=anchor)
    with store._lock:
        store._states.setdefault(name, state)


def delete_step(store, step: int) -> None:
    store._check_open()
    check_step(step)
    with store._lock:
        store._wait_step(step)

        def job() -> None:
            with store._objects.writer(timeout=store._opt.lock_timeout) as w:
                if store._objects.root(root_name(step)) is None:
                    raise StepNotFound(step)
                w.delete_root(root_name(step))

        store._writer.run(job)


def gc(store, keep_last, keep, *, threshold) -> GCReport:
    store._check_open()
    keep_last, keep = check_retention(keep_last, keep)
    if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise InvalidInput(f"threshold must be in [0, 1], got {threshold!r}")

    def job() -> GCReport:
        # The steps are listed under the writer lock: listed before it, another process's
        # delete, rollback or gc could drop one first and this gc then failed on the missing
        # root (or kept by a stale rule). A writer that drops nothing commits nothing.
        with store._objects.writer(timeout=store._opt.lock_timeout) as w:
            steps = list_steps(store._objects)
            kept = set(kept_steps(steps, keep_last=keep_last, keep=keep))
            dropped = [s for s in steps if s not in kept]
            for s in dropped:
                w.delete_root(root_name(s))
        rep: EngineGCReport = store._objects.gc(
            threshold=threshold, timeout=store._opt.lock_timeout
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

    with store._lock:
        report = store._writer.run(job)
        # Blocks of dropped steps may be gone: the diff base must not refer to them.
        for state in store._states.values():
            state.drop_missing(store._objects.has)
    return report


def verify(store, *, deep: bool) -> VerifyReport:
    store._check_open()
    store._writer.drain()
    objects = store._objects
    eng = objects.verify(deep=deep)
    problems = [f"{p.what}: {p.message}" for p in eng.problems]
    # Decoded shape of each block (None: undecodable), decoded once however many tables
    # refer to it, but checked against every referring table's geometry: a crafted table
    # node may list a small block as a huge one.
    seen: dict[bytes, tuple | None] = {}
    steps = list_steps(objects)
    for step in steps:
        try:
            manifest = load_manifest(objects, step)
            if manifest.node.step != step:
                problems.append(f"step {step}: root holds step node of step {manifest.node.step}")
        except (CheckpointError, StoreError) as exc:
            if not _still_there(objects, step):
                continue  # dropped by a gc in another process since it was listed
            problems.append(f"step {step}: {type(exc).__name__}: {exc}")
            continue
        if not deep:
            continue
        for name, tm in manifest.tables.items():
            for i, oid in enumerate(tm.block_ids):
                where = f"step {step} table {name!r} block {i} ({oid.hex()})"
                if oid not in seen:
                    try:
                        seen[oid] = resolve(objects.get, oid).shape
                    except (CheckpointError, StoreError) as exc:
                        seen[oid] = None
                        if not _still_there(objects, step):
                            break  # dropped by a gc in another process since it was listed
                        problems.append(f"{where}: {type(exc).__name__}: {exc}")
                        continue
                start, stop = tm.node.block_range(i)
                shape = seen[oid]
                if shape is not None and shape != (stop - start, tm.node.row_nbytes):
                    problems.append(
                        f"{where}: shape {shape} != {(stop - start, tm.node.row_nbytes)}"
                    )
    return VerifyReport(not problems, tuple(problems), len(steps), len(seen), eng)


def _still_there(objects, step: int) -> bool:
    """False when ``step`` was dropped (by another process) after verify listed it."""
    try:
        return objects.root(root_name(step)) is not None
    except StoreError:
        return True


def stats(store) -> StoreStats:
    store._check_open()
    store._writer.drain()
    objects = store._objects
    steps = list_steps(objects)
    logical = sum(load_step(objects, s)[1].logical_bytes for s in steps)
    st = objects.stats()
    stored = st.stored_bytes or st.logical_bytes  # the memory twin allocates no disk
    ratio = logical / stored if stored else 0.0
    return StoreStats(len(steps), logical, stored, st.objects, ratio)

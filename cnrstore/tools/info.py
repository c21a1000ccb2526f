"""Read-only views of a store: list steps, show a step, disk usage, gc plan, verify.

The Python side of the ``cnrstore`` command (cli.py is a thin layer over it). Every function
takes an open ``CheckpointStore``, an engine ``ObjectStore``, or a path (opened without
creating anything). Sizes come from the engine index (``info``: kind, refs, lengths), so
listing and measuring never read block payloads; only ``verify(deep=True)`` and the row
part of ``diff_steps`` (cnrstore.tools.diff) decode blocks.

Byte counts used throughout:

- *logical*: what the tables take as dense tensors of their dtype (rows * width * itemsize).
- *raw*: uncompressed payload bytes of the objects (after quantization, before zstd).
- *stored*: bytes the objects' records take in the packs (after zstd, with headers).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import engine
from cnrstore.core.retention import kept_steps
from cnrstore.errors import CheckpointError, translating
from cnrstore.format import load
from cnrstore.format import manifest as mf
from cnrstore.format.load import load_step, load_table, load_table_manifest
from cnrstore.format.manifest import DTYPE_SIZES, TableNode
from cnrstore.tools.access import objects_of, opened, tick
from cnrstore.tools.sizes import Sizes, unreachable
from engine import ProgressFn, allocated_bytes

__all__ = [
    "StepSummary",
    "TableDetail",
    "StepDetail",
    "TableUsage",
    "Usage",
    "GCPlan",
    "GCResult",
    "opened",
    "objects_of",
    "list_steps",
    "show_step",
    "disk_usage",
    "gc_plan",
    "kept_steps",
    "collect",
    "diff_steps",
    "verify",
    "repair",
    "disk_bytes",
]


@dataclass(frozen=True)
class StepSummary:
    step: int
    time: float | None     # None (and sizes None) when the step cannot be read: ``problem``
    tables: int | None
    logical_bytes: int | None
    stored_bytes: int | None  # records reachable from the step (shared ones included)
    new_bytes: int | None     # records no lower kept step reaches
    root: str
    problem: str | None = None  # why the step could not be read (damage: see verify)


@dataclass(frozen=True)
class TableDetail:
    name: str
    shape: tuple[int, ...]
    dtype: str
    scheme: str
    block_rows: int
    blocks: int
    full_blocks: int
    patched_blocks: int    # blocks whose newest object is a patch
    max_depth: int         # patches above the full block, worst block
    mean_depth: float
    rows_changed: int | None
    logical_bytes: int
    stored_bytes: int


@dataclass(frozen=True)
class StepDetail:
    step: int
    time: float
    root: str
    metadata: dict
    tables: tuple[TableDetail, ...]
    state: dict = field(default_factory=dict)   # Python values of a put_state step, by path


@dataclass(frozen=True)
class TableUsage:
    name: str
    steps: int
    logical_bytes: int     # summed over the steps holding the table
    referenced_bytes: int  # raw bytes each step's table reaches, summed over steps
    unique_bytes: int      # raw bytes of the distinct objects, over all steps
    stored_bytes: int      # stored bytes of the distinct objects


@dataclass(frozen=True)
class Usage:
    steps: int
    objects: int           # distinct objects reachable from the steps
    logical_bytes: int
    referenced_bytes: int
    unique_bytes: int
    stored_bytes: int
    disk_bytes: int        # allocated by the pack files (dead records included)
    garbage_objects: int   # indexed, reached by no root: what gc reclaims (sizes.unreachable)
    encoding_ratio: float | None     # logical / referenced: quantization (and patches)
    dedup_ratio: float | None        # referenced / unique: sharing between steps
    compression_ratio: float | None  # unique / stored: zstd
    overall_ratio: float | None      # logical / stored
    tables: tuple[TableUsage, ...]


@dataclass(frozen=True)
class GCPlan:
    keep: tuple[int, ...]
    drop: tuple[int, ...]
    objects_freed: int     # reachable only from dropped steps
    bytes_freed: int       # their stored bytes (before compaction rounds to packs)
    garbage_objects: int   # already unreachable before the drop (sizes.unreachable)


@dataclass(frozen=True)
class GCResult:
    """cnrstore.GCReport plus what a gc on a bucket or shared directory could not free
    yet: the packs it retired stay ``grace_s`` after its commit for readers of the old
    index (engine/store/commit/bucket.py), and a gc run after that deletes them."""

    steps_deleted: tuple[int, ...]
    steps_kept: tuple[int, ...]
    objects_live: int
    objects_freed: int
    bytes_freed: int
    packs_rewritten: int
    packs_deleted: int
    packs_held: int = 0        # packs no longer listed, kept for the grace period
    bytes_held: int = 0
    grace_s: float | None = None  # the grace period (None: a directory store, no grace)


def table_logical_bytes(node: TableNode) -> int:
    # A decoded node names an allow-listed dtype (TableNode.decode checks it).
    return node.rows * node.width * DTYPE_SIZES[node.dtype]


def python_values(doc: dict) -> dict[str, object]:
    """The Python leaves of a put_state structure document (docs/MANIFEST.md, "State") by
    "/"-joined path; tuples and lists of them come back as lists."""
    out: dict[str, object] = {}

    def walk(node: dict, path: str) -> None:
        if "p" in node:
            out[path] = node["p"]
        elif "d" in node:
            for key, child in node["d"]:
                walk(child, f"{path}/{key}" if path else str(key))
        elif "l" in node or "t" in node:
            for i, child in enumerate(node["l"] if "l" in node else node["t"]):
                walk(child, f"{path}/{i}" if path else str(i))

    walk(doc, "")
    return out


def disk_bytes(path: str | os.PathLike) -> int:
    """Bytes allocated on disk by the files under ``path`` (st_blocks, as ``du`` counts;
    sparse and preallocated files count what they occupy), 0 if it is gone."""
    total = 0
    for root, _dirs, files in os.walk(os.fspath(path)):
        total += sum(allocated_bytes(os.path.join(root, name)) for name in files)
    return total


@translating
def list_steps(store, *, progress: ProgressFn | None = None) -> list[StepSummary]:
    """Every kept step, ascending, with its sizes. ``new_bytes`` counts the records that
    no lower step reaches: what keeping this step costs on top of the earlier ones."""
    with opened(store) as objects:
        sizes = Sizes(objects)
        earlier: set[bytes] = set()
        out = []
        steps = load.list_steps(objects)
        for i, step in enumerate(steps):
            tick(progress, i, len(steps))
            try:
                oid, node = load_step(objects, step)
                mine = sizes.reach(oid)
            except (CheckpointError, engine.StoreError) as exc:
                # One damaged step does not hide the others: it is listed with its problem.
                root = objects.root(mf.root_name(step))
                out.append(StepSummary(step, None, None, None, None, None,
                                       root.hex() if root else "", problem_text(exc)))
                continue
            new = mine - earlier
            earlier |= mine
            out.append(StepSummary(step, node.time, len(node.tables), node.logical_bytes,
                                   sizes.stored(mine), sizes.stored(new), oid.hex()))
        return out


def problem_text(exc: BaseException) -> str:
    """One line saying what is wrong, for a listing that goes on past it."""
    return " ".join(str(exc).split()) or type(exc).__name__


@translating
def show_step(store, step: int) -> StepDetail:
    """The tables of one step: geometry, scheme, block chains and sizes (no block reads)."""
    with opened(store) as objects:
        sizes = Sizes(objects)
        oid, node = load_step(objects, step)
        tables = []
        for name, toid in zip(node.tables, node.table_ids):
            tm = load_table_manifest(objects, toid)
            depth = tm.depth
            full = sum(1 for d in depth if d == 0)
            t = tm.node
            tables.append(TableDetail(
                name=name, shape=t.shape, dtype=t.dtype, scheme=t.scheme,
                block_rows=t.block_rows, blocks=len(depth), full_blocks=full,
                patched_blocks=len(depth) - full, max_depth=max(depth, default=0),
                mean_depth=sum(depth) / len(depth) if depth else 0.0,
                rows_changed=node.rows_changed.get(name),
                logical_bytes=table_logical_bytes(t),
                stored_bytes=sizes.stored(sizes.reach(toid)),
            ))
        values = python_values(node.state) if node.state is not None else {}
        return StepDetail(step, node.time, oid.hex(), dict(node.metadata), tuple(tables),
                          values)


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


@translating
def disk_usage(store, *, progress: ProgressFn | None = None) -> Usage:
    """Logical vs stored bytes of the kept steps, overall and per table name."""
    with opened(store) as objects:
        sizes = Sizes(objects)
        everything: set[bytes] = set()
        per_table: dict[str, list] = {}  # name -> [steps, logical, referenced, ids]
        logical = referenced = 0
        steps = load.list_steps(objects)
        for i, step in enumerate(steps):
            tick(progress, i, len(steps))
            oid, node = load_step(objects, step)
            mine = sizes.reach(oid)
            everything |= mine
            logical += node.logical_bytes
            referenced += sizes.raw(mine)
            for name, toid in zip(node.tables, node.table_ids):
                t = load_table(objects, toid)
                ids = sizes.reach(toid)
                acc = per_table.setdefault(name, [0, 0, 0, set()])
                acc[0] += 1
                acc[1] += table_logical_bytes(t)
                acc[2] += sizes.raw(ids)
                acc[3] |= ids
        unique, stored = sizes.raw(everything), sizes.stored(everything)
        stats = objects.stats()
        garbage = unreachable(objects, sizes, everything)
        tables = tuple(
            TableUsage(name, n, lg, ref, sizes.raw(ids), sizes.stored(ids))
            for name, (n, lg, ref, ids) in sorted(per_table.items())
        )
        return Usage(
            steps=len(steps), objects=len(everything), logical_bytes=logical,
            referenced_bytes=referenced, unique_bytes=unique, stored_bytes=stored,
            disk_bytes=stats.stored_bytes,
            garbage_objects=garbage,
            encoding_ratio=_ratio(logical, referenced), dedup_ratio=_ratio(referenced, unique),
            compression_ratio=_ratio(unique, stored), overall_ratio=_ratio(logical, stored),
            tables=tables,
        )


@translating
def gc_plan(store, *, keep_last: int | None, keep: Iterable[int] = ()) -> GCPlan:
    """What ``gc(keep_last=..., keep=...)`` would drop and free, changing nothing."""
    with opened(store) as objects:
        sizes = Sizes(objects)
        have = load.list_steps(objects)
        kept = kept_steps(have, keep_last=keep_last, keep=keep)
        drop = [s for s in have if s not in set(kept)]
        live: set[bytes] = set()
        for name, oid in objects.roots().items():  # roots of no step (cnrstore/options)
            if mf.step_of_root(name) is None:
                sizes.reach(oid, live)
        for s in kept:
            sizes.reach(load_step(objects, s)[0], live)
        dead: set[bytes] = set()
        for s in drop:
            sizes.reach(load_step(objects, s)[0], dead)
        dead -= live
        garbage = unreachable(objects, sizes, live | dead)
        return GCPlan(tuple(kept), tuple(drop), len(dead), sizes.stored(dead), garbage)


@translating
def collect(store, *, keep_last: int | None, keep: Iterable[int] = (),
            grace_s: float | None = None) -> GCResult:
    """Run the store's gc (which applies cnrstore.core.retention's rule, as the dry run does)
    and say what it left for later. ``store`` must be a CheckpointStore: gc drops steps.
    ``grace_s``: the gc grace period of a store on a bucket or a shared directory, whose
    retired packs are then counted as held (packs the storage has that the index no longer
    lists); None for a directory store, which deletes them at once."""
    report = store.gc(keep_last=keep_last, keep=list(keep))
    held = held_bytes = 0
    storage = getattr(objects_of(store), "storage", None)  # a PackStore's; no twin has one
    if grace_s is not None and storage is not None:
        stats = objects_of(store).stats()
        sizes = storage.sizes()
        held = max(len(sizes) - stats.packs, 0)
        held_bytes = max(sum(sizes.values()) - stats.stored_bytes, 0)
    return GCResult(report.steps_deleted, report.steps_kept, report.objects_live,
                    report.objects_freed, report.bytes_freed, report.packs_rewritten,
                    report.packs_deleted, held, held_bytes, grace_s)


@translating
def diff_steps(store, a: int, b: int, *, rows: bool = True):
    """Which tables, blocks and rows differ between steps ``a`` and ``b``
    (cnrstore.tools.diff.StepDiff): ids compared top-down, only differing blocks read."""
    from cnrstore.tools.diff import diff_steps as _diff

    with opened(store) as objects:
        return _diff(objects, a, b, rows=rows)


# Integrity checks live in cnrstore.tools.check (which builds on this module); these wrappers
# give the CLI and users one entry point without a circular import.
@translating
def verify(store, *, deep: bool = True, steps: Iterable[int] | None = None,
           progress: ProgressFn | None = None):
    """cnrstore.tools.check.verify: engine and manifest checks; returns a VerifyResult."""
    from cnrstore.tools.check import verify as _verify

    return _verify(store, deep=deep, steps=steps, progress=progress)


@translating
def repair(path: str | os.PathLike, *, dry_run: bool = False, on_plan=None,
           cache_dir: str | os.PathLike | None = None):
    """cnrstore.tools.check.repair: rebuild the index of the store at ``path`` from its packs
    (``dry_run``: only say what it would do); returns a RepairResult."""
    from cnrstore.tools.check import repair as _repair

    return _repair(path, dry_run=dry_run, on_plan=on_plan, cache_dir=cache_dir)

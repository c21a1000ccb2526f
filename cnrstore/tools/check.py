"""Integrity checks of a store for the tools and the CLI: ``verify`` is the store's own
check (cnrstore/core/verify.py) over a CheckpointStore, an engine store or a path;
``repair`` rebuilds the engine index from the packs, saying first what it will do, and
names the steps and tables the damage it found touches (docs/FORMAT.md "Recovery and
repair")."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import engine
from cnrstore.core.verify import StepProblem, VerifyResult, verify_objects
from cnrstore.format.manifest import StepNode, step_of_root
from cnrstore.tools.access import opened
from engine import ProgressFn, plan_at

__all__ = ["StepProblem", "VerifyResult", "verify", "repair", "RepairResult", "RootDamage"]


def verify(store, *, deep: bool = False, steps: Iterable[int] | None = None,
           progress: ProgressFn | None = None) -> VerifyResult:
    """cnrstore.core.verify.verify_objects on the engine store of ``store``."""
    with opened(store) as objects:
        return verify_objects(objects, deep=deep, steps=steps, progress=progress)


@dataclass(frozen=True)
class RootDamage:
    """One root (a step, or another root of the store) whose objects are not all intact."""

    root: str
    step: int | None           # None for a root that is not a step's
    action: str                # "damaged" (kept), "rolled-back" or "dropped"
    tables: tuple[str, ...]    # tables of a kept step that reach lost objects
    lost: tuple[bytes, ...]    # objects no pack holds intact
    reason: str


@dataclass(frozen=True)
class RepairResult:
    """engine.RepairReport with the steps and tables named (``roots``)."""

    dry_run: bool
    packs_scanned: int
    objects_indexed: int
    roots_restored: int
    damaged: tuple[engine.Problem, ...]
    roots: tuple[RootDamage, ...]


def repair(path: str | os.PathLike, *, dry_run: bool = False,
           on_plan: Callable[[RepairResult], None] | None = None,
           cache_dir: str | os.PathLike | None = None) -> RepairResult:
    """Rebuild the index of the store at ``path`` from its packs (engine.repair).

    The packs are scanned first into a plan (never writing a byte), given to ``on_plan``
    (the CLI prints it); with ``dry_run`` that plan is the result. Repair keeps every step
    that still partly reads: a table that lost objects raises CorruptData (MissingObject)
    naming them, every other table of the step reads as before.

    A store on S3 or a shared directory (``cache_dir``) rebuilds its index cache from its
    commit documents, or from its packs when one is damaged (the report names it); it has
    no dry run."""
    if cache_dir is not None or os.fspath(path).startswith("s3://"):
        if cache_dir is None or dry_run:
            raise ValueError(f"{os.fspath(path)}: repair of a store on S3 or a shared "
                             "directory needs its cache_dir and has no dry run")
        with engine.storage_open(os.fspath(path), cache_dir=cache_dir,
                                 create=False) as objects:
            return _named(objects.repair())
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no store at {os.fspath(path)!r}")
    plan = replace(_named(plan_at(path)), dry_run=dry_run)  # what is about to be done
    if on_plan is not None:
        on_plan(plan)
    if dry_run:
        return plan
    with engine.open(path, create=False) as objects:
        return _named(objects.repair())


def _named(r: engine.RepairReport) -> RepairResult:
    return RepairResult(r.dry_run, r.packs_scanned, r.objects_indexed, r.roots_restored,
                        r.damaged, tuple(_damage(x) for x in r.roots))


def _damage(r: engine.RootRepair) -> RootDamage:
    step = step_of_root(r.name)
    tables: tuple[str, ...] = ()
    if r.action == "damaged" and step is not None and r.node is not None:
        hit = {ref for ref, _ in r.branches}
        try:
            node = StepNode.decode(r.node, r.oid)
            tables = tuple(t for t, oid in zip(node.tables, node.table_ids) if oid in hit)
        except Exception:  # a step node that does not decode names no table
            tables = ()
    return RootDamage(r.name, step, r.action, tables, r.lost, r.reason)

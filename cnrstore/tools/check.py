"""Integrity checks of a store for the tools and the CLI: ``verify`` is the store's own
check (cnrstore/core/verify.py) over a CheckpointStore, an engine store or a path;
``repair`` rebuilds the engine index from the packs."""

from __future__ import annotations

import os
from collections.abc import Iterable

import engine
from cnrstore.core.verify import StepProblem, VerifyResult, verify_objects
from cnrstore.tools.access import opened
from engine.api import ProgressFn

__all__ = ["StepProblem", "VerifyResult", "verify", "repair"]


def verify(store, *, deep: bool = False, steps: Iterable[int] | None = None,
           progress: ProgressFn | None = None) -> VerifyResult:
    """cnrstore.core.verify.verify_objects on the engine store of ``store``."""
    with opened(store) as objects:
        return verify_objects(objects, deep=deep, steps=steps, progress=progress)


def repair(path: str | os.PathLike) -> engine.RepairReport:
    """Rebuild the index of the store at ``path`` from its packs (engine.repair)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no store at {os.fspath(path)!r}")
    with engine.open(path, create=False) as objects:
        return objects.repair()

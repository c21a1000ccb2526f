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


def repair(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
           ) -> engine.RepairReport:
    """Rebuild the index of the store at ``path`` from its packs (engine.repair); a store
    on S3 or a shared directory rebuilds its index cache in ``cache_dir`` from its commit
    documents, or from its packs when one is damaged (the report names it)."""
    if cache_dir is not None or os.fspath(path).startswith("s3://"):
        if cache_dir is None:
            raise ValueError(f"{os.fspath(path)}: a store on S3 needs a cache_dir")
        with engine.storage_open(os.fspath(path), cache_dir=cache_dir,
                                 create=False) as objects:
            return objects.repair()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no store at {os.fspath(path)!r}")
    with engine.open(path, create=False) as objects:
        return objects.repair()

"""Importing cnrstore's modules without the cyclic garbage collector's full passes."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_collector"]


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """The cyclic garbage collector paused while cnrstore's modules import. Once torch is
    imported a process tracks ~10^6 objects, and the allocations of importing the store
    API set off full collections over all of them: 0.10 s of a fresh process's first
    ``open`` (0.157 s against 0.056 s with the collector paused,
    benches/results/bench_put.md, 2026-12-06), 2 full and 19 younger collections of
    ``import cnrstore.dcp``. Imports make no garbage cycles worth collecting; the
    collector's state is restored, so a caller that disabled it keeps it disabled. The
    entry points a user imports directly (cnrstore.dcp, cnrstore.distributed.torchrec)
    import under it too (a module of its own, so that they need not import the
    package's __init__, which names them for type checkers)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

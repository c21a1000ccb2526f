"""Store handles still open at interpreter exit are closed then, so a non-blocking put
that was never waited for still commits (writer threads are daemons and would be killed).

Closed newest first: a distributed handle opens its coordinator's plain store before it
registers itself, so it drains its queued puts through that store before the store
closes."""

from __future__ import annotations

import atexit
import threading
import weakref
from typing import Any

__all__ = ["close_at_exit", "forget"]

_OPEN: dict[int, weakref.ref] = {}  # insertion order is opening order
_LOCK = threading.Lock()


def close_at_exit(handle: Any) -> None:
    """Close ``handle`` (anything with ``close()``) at exit unless it is gone by then."""
    key = id(handle)
    with _LOCK:
        _OPEN[key] = weakref.ref(handle, lambda _: _drop(key))


def forget(handle: Any) -> None:
    """``handle`` was closed: nothing to do for it at exit."""
    with _LOCK:
        ref = _OPEN.get(id(handle))
        if ref is not None and ref() is handle:
            del _OPEN[id(handle)]


def _drop(key: int) -> None:
    with _LOCK:
        ref = _OPEN.get(key)
        if ref is not None and ref() is None:
            del _OPEN[key]


@atexit.register
def _close_all() -> None:
    with _LOCK:
        handles = [ref() for ref in reversed(list(_OPEN.values()))]
    for handle in handles:
        if handle is None:
            continue
        try:
            handle.close()
        except Exception:  # exiting anyway; one broken store must not stop the others
            pass

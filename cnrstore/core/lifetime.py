"""Store handles still open at interpreter exit are closed then, so a non-blocking put
that was never waited for still commits (writer threads are daemons and would be killed).

Closed newest first: a distributed handle opens its coordinator's plain store before it
registers itself, so it drains its queued puts through that store before the store
closes."""

from __future__ import annotations

import atexit
import weakref
from typing import Any

__all__ = ["close_at_exit", "forget"]

# id -> handle, in opening order; a handle that is garbage-collected drops out by itself.
_OPEN: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def close_at_exit(handle: Any) -> None:
    """Close ``handle`` (anything with ``close()``) at exit unless it is gone by then."""
    _OPEN[id(handle)] = handle


def forget(handle: Any) -> None:
    """``handle`` was closed: nothing to do for it at exit."""
    if _OPEN.get(id(handle)) is handle:
        del _OPEN[id(handle)]


@atexit.register
def _close_all() -> None:
    for handle in reversed(list(_OPEN.values())):
        try:
            handle.close()
        except Exception:  # exiting anyway; one broken store must not stop the others
            pass

"""How many cores this process may run on: the size of the codec's own thread pools."""

from __future__ import annotations

import os

__all__ = ["cores"]


def cores() -> int:
    """The CPUs this process is allowed (its affinity; the CPU count where the platform
    has no affinity call, as macOS)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)

"""How many cores this process may run on, and the threads the package starts on them."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["cores", "start_thread", "thread_pool"]


def cores() -> int:
    """The CPUs this process is allowed (its affinity; the CPU count where the platform
    has no affinity call, as macOS)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


# torch marks its intra-op thread pool corrupt in a forked child and rebuilds it on the
# next use, and that rebuild is not thread-safe: threads running their first torch op at
# the same time can find no pool at all ("pool INTERNAL ASSERT FAILED ... Invalid thread
# pool!"; 21-33 of 50 children with 32 threads, torch 2.13). Rebuilding it once in the
# thread that starts ours, before any of them exists, leaves them nothing to race on.
_forked = False
_forked_lock = threading.Lock()


def _after_fork() -> None:
    global _forked, _forked_lock
    _forked = True
    _forked_lock = threading.Lock()  # a parent thread may have held it at fork()


os.register_at_fork(after_in_child=_after_fork)


def _torch_pool_rebuilt() -> None:
    global _forked
    with _forked_lock:
        if _forked:
            import torch  # the codec's callers have it loaded; engine code never comes here

            torch.set_num_threads(torch.get_num_threads())
            _forked = False


def thread_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads may run torch ops, in the parent or a forked child."""
    _torch_pool_rebuilt()
    return ThreadPoolExecutor(workers, thread_name_prefix=name)


def start_thread(target: Callable[..., Any], name: str, args: tuple = (),
                 daemon: bool = True) -> threading.Thread:
    """A started thread that may run torch ops, in the parent or a forked child."""
    _torch_pool_rebuilt()
    t = threading.Thread(target=target, name=name, args=args, daemon=daemon)
    t.start()
    return t

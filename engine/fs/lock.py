"""The single-writer lock: ``fcntl.flock`` on ``<store>/lock`` plus a thread lock.

flock locks belong to an open file description, so two handles on one store in the same
process exclude each other like two processes do; the thread lock makes threads sharing
one handle wait their turn too (docs/FORMAT.md "Locking"). The kernel drops the flock
when the holder dies, so a crashed writer never leaves the store locked.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

from ..errors import StoreLocked

_POLL_S = 0.02


class WriterLock:
    def __init__(self, path: str | os.PathLike) -> None:
        self._path = os.fspath(path)
        self._thread_lock = threading.Lock()
        self._fd: int | None = None

    def acquire(self, timeout: float | None) -> None:
        """Take the lock, waiting up to ``timeout`` seconds (None: forever)."""
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
            raise ValueError(f"timeout must be None or a number >= 0, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._thread_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise StoreLocked(f"store {self._path} already has a writer in this process")
        try:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                self._flock(fd, deadline)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        except BaseException:
            self._thread_lock.release()
            raise

    def _flock(self, fd: int, deadline: float | None) -> None:
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreLocked(
                        f"store {os.path.dirname(self._path)} is locked by another writer"
                    ) from None
                time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
            self._thread_lock.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

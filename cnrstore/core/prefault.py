"""Fault in a fresh output tensor's pages on a thread of its own, ahead of the decode.

A restore into fresh memory spends most of its time in page faults: this VM first-touches
anonymous memory at ~2.5 GB/s per core, slower than it copies from the page cache. One
thread asking the kernel to map the pages (``MADV_POPULATE_WRITE``, Linux 5.14+: the pages
are allocated as a write fault would, without the write, so the data that the decode
threads write meanwhile is never touched) does that work once, in order, ahead of the
readers; on a cold cache it uses the CPU time the readers spend waiting on the disk.
Where the call is unavailable this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Sequence

import torch

from cnrstore.codec.cores import start_thread

__all__ = ["Prefault"]

_MADV_POPULATE_WRITE = 23
_CHUNK = 16 << 20
_MIN_BYTES = 64 << 20  # below this a thread costs more than it saves

_libc: ctypes.CDLL | None = None
_broken = False  # the kernel refused once (older than 5.14): never try again
_lock = threading.Lock()


def _madvise():
    global _libc
    with _lock:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        return _libc.madvise


class Prefault:
    """Populates the pages of ``tensors`` in order on a daemon thread until done or
    stopped: all the tables of one restore, so that the next table's memory is mapped
    while the decode finishes one. ``stop()`` waits for it: the memory must outlive every
    madvise on it."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        spans = []
        if not _broken and sys.platform.startswith("linux"):
            page = os.sysconf("SC_PAGE_SIZE")
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                if t.device.type != "cpu" or nbytes < _MIN_BYTES:
                    continue
                start = -(-t.data_ptr() // page) * page
                end = (t.data_ptr() + nbytes) // page * page
                if end > start:
                    spans.append((start, end))
        if not spans:
            return
        self._tensors = list(tensors)  # keeps the memory mapped while the thread runs
        self._thread = start_thread(self._run, "cnrstore-prefault", args=(spans,))

    def _run(self, spans: list[tuple[int, int]]) -> None:
        global _broken
        madvise = _madvise()
        for start, end in spans:
            for at in range(start, end, _CHUNK):
                if self._stop.is_set():
                    return
                if madvise(at, min(_CHUNK, end - at), _MADV_POPULATE_WRITE) != 0:
                    if ctypes.get_errno() == 22:  # EINVAL: no MADV_POPULATE_WRITE here
                        _broken = True
                    return  # ENOMEM & co: the decode's own faults report a real shortage

    def stop(self) -> None:
        """Stop populating (what is left the decode faults in itself) and wait."""
        self._stop.set()
        self.join()

    def join(self) -> None:
        """Wait until every page is populated (or the thread stopped)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            del self._tensors

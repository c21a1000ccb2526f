"""Early writeback: ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` through libc.

Python's os module has no sync_file_range. A pack being appended asks the kernel to
start writing its bytes to disk while the writer computes the next records, so the fsync
at commit waits for the tail only (docs/design/put-path.md, "Early writeback"). It is a hint:
durability still comes from the fsync, and where the call is missing (not Linux) or
fails, nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

SYNC_FILE_RANGE_WRITE = 2

_fn = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _fn = _libc.sync_file_range
        _fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        _fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        _fn = None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writeback of ``[offset, offset + length)`` of ``fd``; never waits for it,
    never raises (a failure here changes nothing the fsync does not redo)."""
    if _fn is not None and length > 0:
        _fn(fd, offset, length, SYNC_FILE_RANGE_WRITE)


# Appended bytes after which a pack starts their writeback.
WRITEBACK_CHUNK = 16 << 20


class Writeback:
    """Starts writeback of a pack being appended, WRITEBACK_CHUNK at a time, through its
    sink's ``start_writeback`` (sinks without one, e.g. a bucket's, ignore it)."""

    def __init__(self, sink: object) -> None:
        self._start = getattr(sink, "start_writeback", None)
        self._done = 0  # bytes whose writeback was started

    def advance(self, size: int) -> None:
        if size - self._done >= WRITEBACK_CHUNK:
            if self._start is not None:
                self._start(self._done, size - self._done)
            self._done = size

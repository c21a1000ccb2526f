"""What the benchmark measures with, outside of any system under test.

- Bytes on disk are allocated blocks (st_blocks * 512) summed over a directory, as ``du``
  counts them: sparse LMDB maps and preallocated files count only what they occupy, and a
  system cannot claim fewer bytes than it really wrote.
- Peak memory is the kernel's resident-set high-water mark. On Linux it can be reset
  (``/proc/self/clear_refs`` with "5"), which gives a peak per phase in one process;
  where that is refused, the process-wide ``ru_maxrss`` is the fallback and the report
  says which one was used.
- Cold reads: dropping the whole page cache needs root and disturbs everyone on a shared
  machine, so the default evicts only the benchmark's own files (posix_fadvise
  DONTNEED, which drops clean pages of a file without privileges). ``drop_caches`` is tried
  only when asked for.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import resource
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "Measured",
    "PeakMemory",
    "disk_bytes",
    "evict_page_cache",
    "fsync_dir",
    "resident_pages",
    "timed",
]


def disk_bytes(path: str | os.PathLike) -> int:
    """Allocated bytes of ``path`` and everything under it (files and directories)."""
    total = 0
    try:
        total += os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0
    for root, dirs, files in os.walk(os.fspath(path)):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass  # a file removed while we walk (a system's own cleanup) is not bytes
    return total


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a new entry in it survives a crash (what a real save needs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict_page_cache(path: str | os.PathLike, *, drop_caches: bool = False) -> str:
    """Make the next reads of ``path`` (a file, or the files under a directory) come from
    disk, as far as allowed.

    Returns how: "drop_caches" (the whole cache was dropped), "fadvise" (each file's clean
    pages were dropped), or "none" (not supported here: reads may be warm).
    """
    if drop_caches:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass  # not root, or /proc/sys read-only in a container: fall back per file
    if not hasattr(os, "posix_fadvise"):
        return "none"
    # A file is evicted as itself (os.walk of a file yields nothing: it was left warm).
    top = os.fspath(path)
    walk = ([(os.path.dirname(top), [], [os.path.basename(top)])] if os.path.isfile(top)
            else os.walk(top))
    for root, _dirs, files in walk:
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                # Dirty pages cannot be dropped; every system fsyncs, but be sure.
                os.fdatasync(fd)
                _drop_pages(fd)
            finally:
                os.close(fd)
    return "fadvise"


def _drop_pages(fd: int, tries: int = 6) -> None:
    # DONTNEED skips pages the kernel still holds in a per-CPU batch (those just read,
    # often on another core): CI saw a file read a moment before stay warm. So the drop is
    # checked with mincore (which, unlike a RWF_NOWAIT read, starts no readahead) and
    # repeated.
    for attempt in range(tries):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if not resident_pages(fd):
            return
        time.sleep(0.002 * 2**attempt)


def resident_pages(fd: int) -> int:
    """Pages of the open file ``fd`` now in the page cache (0 where it cannot be told)."""
    size = os.fstat(fd).st_size
    libc = _libc()
    if size == 0 or libc is None:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return 0
    try:
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            return 0
        return sum(b & 1 for b in bytes(vec))
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)


@functools.cache
def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None  # no mincore here: the drop is done once, unchecked


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of calling ``fn`` once, by the monotonic high-resolution clock."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Resident-set high-water marks per phase of one process.

    ``start()`` begins a phase (resetting the kernel's mark when it can); ``stop()``
    returns the phase's peak RSS in bytes and how far above the RSS at ``start()`` it went.
    """

    def __init__(self) -> None:
        self.method = "clear_refs" if self._reset() else "ru_maxrss"
        self._base = 0

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")
        except OSError:
            return False
        return _status_kb("VmHWM") is not None

    @staticmethod
    def rss() -> int:
        kb = _status_kb("VmRSS")
        if kb is None:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return kb * 1024

    def start(self) -> None:
        if self.method == "clear_refs":
            self._reset()
        self._base = self.rss()

    def stop(self) -> dict[str, int]:
        if self.method == "clear_refs":
            peak = (_status_kb("VmHWM") or 0) * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"peak_rss": peak, "peak_over_start": max(0, peak - self._base)}


class Measured:
    """CPU seconds (the whole process, and its main thread: the rest is background threads
    such as a non-blocking put's writer), page faults, bytes read (from storage, and
    through read calls) and wall time of a timed region of a rank; with ``profile`` (a
    directory), the main thread's cProfile too."""

    def __init__(self, profile: str | None, name: str, rank: int):
        self.path = os.path.join(profile, f"{name}_{rank}") if profile else None
        self.prof: Any = None
        self.got: dict[str, float] = {}

    @staticmethod
    def _now() -> tuple:
        s, t = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
            resource.RUSAGE_THREAD)
        io = {}
        try:  # bytes this process had fetched from storage (not the page cache), Linux
            with open("/proc/self/io") as f:
                io = dict(line.split(": ") for line in f.read().splitlines())
        except OSError:
            pass
        return (time.perf_counter(), s.ru_utime + s.ru_stime, t.ru_utime + t.ru_stime,
                s.ru_minflt, s.ru_majflt, int(io.get("read_bytes", 0)),
                int(io.get("rchar", 0)))

    def __enter__(self) -> Measured:
        if self.path:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()
        self.t0 = self._now()
        return self

    def __exit__(self, *exc: Any) -> None:
        t1 = self._now()
        if self.prof is not None:
            self.prof.disable()
        keys = ("wall_s", "cpu_s", "main_cpu_s", "minflt", "majflt", "disk_read_bytes",
                "read_chars")
        self.got = {k: y - x for k, x, y in zip(keys, self.t0, t1)}
        self.got["bg_cpu_s"] = self.got["cpu_s"] - self.got["main_cpu_s"]
        if self.prof is not None and self.path:
            import io
            import json
            import pstats

            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.prof.dump_stats(self.path + ".prof")
            buf = io.StringIO()
            st = pstats.Stats(self.prof, stream=buf)
            st.sort_stats("cumulative").print_stats(45)
            st.sort_stats("tottime").print_stats(30)
            with open(self.path + ".txt", "w") as f:
                f.write(json.dumps(self.got) + "\n" + buf.getvalue())

"""Small file primitives with the durability rules of docs/FORMAT.md "Write ordering".

Pack files are append-only and written by ``engine.pack``; everything that replaces a
whole file goes through ``atomic_write`` (temp file in the same directory, write, fsync,
rename, fsync the directory), so a crash leaves either the old or the new file.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

from ..errors import StoreError


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (created, renamed or deleted files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: pathlib.Path) -> None:
    """Create ``path`` and missing parents, fsyncing each parent that gained an entry."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        fsync_dir(d.parent)


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        # A full disk (or any failed write) leaves no half-written temporary file behind.
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def writev_all(fd: int, parts: Sequence[bytes | bytearray | memoryview]) -> int:
    """Write ``parts`` back to back with as few syscalls as the kernel allows; return the
    bytes written. Saves joining large payloads into one buffer first."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    total = sum(len(v) for v in views)
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """Read exactly ``length`` bytes or fewer only at end of file (caller checks)."""
    chunks = []
    while length > 0:
        chunk = os.pread(fd, min(length, 1 << 30), offset)
        if not chunk:
            break
        chunks.append(chunk)
        length -= len(chunk)
        offset += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def allocated_bytes(path: str | os.PathLike) -> int:
    """Bytes the file occupies on disk (st_blocks), 0 if it is gone."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def store_error(what: str, exc: OSError) -> StoreError:
    """Wrap an OSError at the engine boundary (callers ``raise store_error(...) from exc``)."""
    return StoreError(f"{what}: {exc.strerror or exc}")

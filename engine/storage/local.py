"""Packs as files under ``<store>/packs/XX/NNNNNNNN.pack`` (docs/FORMAT.md "Directory
tree"): exactly the bytes and the fsync discipline the engine always had."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

from ..format import trailer
from ..format.names import list_pack_files, pack_name, pack_path
from ..format.trailer import read_trailer
from ..fs.fileio import allocated_bytes, fsync_dir, makedirs_durable, write_all, writev_all
from ..fs.writeback import start_writeback
from .base import PackStorage, WritablePack


class LocalSink(WritablePack):
    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        makedirs_durable(path.parent)
        # O_EXCL: a number is never reused while a file of that name exists.
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        write_all(self._fd, data)

    def writev(self, parts: Sequence[bytes | memoryview]) -> int:
        return writev_all(self._fd, parts)

    def finish(self) -> None:
        os.fsync(self._fd)

    def start_writeback(self, offset: int, length: int) -> None:
        """Ask the kernel to start writing ``length`` bytes from ``offset`` to disk, not
        waiting for it (a hint: ``finish`` still fsyncs)."""
        start_writeback(self._fd, offset, length)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LocalStorage(PackStorage):
    """The packs of the store directory ``root``."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = pathlib.Path(root)

    def path(self, n: int) -> pathlib.Path:
        return pack_path(self.root, n)

    def create(self, n: int, *, meta: bool) -> WritablePack:
        return LocalSink(self.path(n))

    def read(self, n: int, offset: int, length: int) -> bytes:
        with open(self.path(n), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def read_all(self, n: int) -> bytes:
        return self.path(n).read_bytes()

    def size(self, n: int) -> int:
        return os.stat(self.path(n)).st_size

    def read_trailer(self, n: int) -> list[trailer.TrailerEntry]:
        return read_trailer(self.path(n), name=pack_name(n))

    def sizes(self) -> dict[int, int]:
        """Allocated bytes (``st_blocks``), what a directory store reports as stored."""
        return {n: allocated_bytes(p) for n, p in list_pack_files(self.root).items()}

    def delete(self, n: int) -> bool:
        path = self.path(n)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(path.parent)
        return True

    def modified(self, n: int) -> float:
        return os.stat(self.path(n)).st_mtime

    def sync_packs(self, ns: Sequence[int]) -> None:
        dirs = set()
        for n in ns:
            path = self.path(n)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(path.parent)
        for d in dirs:
            fsync_dir(d)

    def locator(self) -> tuple[str, str]:
        return ("dir", os.fspath(self.root))

    def describe(self) -> str:
        return os.fspath(self.root)

"""Objects as files under a directory (docs/FORMAT.md "Directory tree"): the key is the
path below the root, with exactly the bytes and the fsync discipline the engine always
had (a pack file ``packs/XX/NNNNNNNN.pack`` is written in place, O_EXCL, fsync'ed)."""

from __future__ import annotations

import os
import pathlib
import uuid
from collections.abc import Sequence

from ..fs.fileio import fsync_dir, makedirs_durable, write_all, writev_all
from ..fs.writeback import start_writeback
from .base import KeyInfo, KeyWriter, ObjectBackend, check_key


class FileWriter(KeyWriter):
    """An object streamed into the file ``path``, created O_EXCL: a key is never written
    twice while a file of that name exists."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = self.file = path
        makedirs_durable(path.parent)
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
            os.unlink(self.file)
        except FileNotFoundError:
            pass


class DirectoryBackend(ObjectBackend):
    """The objects under the directory ``root`` (a store directory: its ``packs/``)."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = pathlib.Path(root)

    def file(self, key: str) -> pathlib.Path:
        return self.root / check_key(key)

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        with open(self.file(key), "rb") as f:
            if limit is None:
                return f.read()
            # read(n) allocates n bytes up front: ask for no more than the file holds.
            return f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        with open(self.file(key), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def head(self, key: str) -> KeyInfo:
        path = self.file(key)
        st = os.stat(path)
        return KeyInfo(key, st.st_size, st.st_mtime, st.st_blocks * 512)

    def _publish(self, key: str, data: bytes, *, replace: bool) -> None:
        # Written whole to a temp file and fsync'ed first: a crash leaves the old object
        # or the new one, plus at worst a dot-file that no listing reads.
        path = self.file(key)
        makedirs_durable(path.parent)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            if replace:
                os.replace(tmp, path)
            else:
                try:
                    # link is atomic and refuses an existing name (NFS and Lustre too).
                    os.link(tmp, path)
                except FileExistsError:
                    raise FileExistsError(f"{key} already exists in {self.describe()}"
                                          ) from None
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        fsync_dir(path.parent)

    def put(self, key: str, data: bytes) -> None:
        self._publish(key, data, replace=True)

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._publish(key, data, replace=False)

    def list(self, prefix: str, *, after: str | None = None) -> list[KeyInfo]:
        """Files whose key starts with ``prefix`` (dot-files of an unfinished put are not
        objects), in key order; a file deleted meanwhile is skipped."""
        head, _, _ = prefix.rpartition("/")
        base = self.root / check_key(head) if head else self.root
        out = []
        for dirpath, subdirs, names in os.walk(base):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
            rel = pathlib.Path(dirpath).relative_to(self.root).as_posix()
            for name in names:
                if name.startswith("."):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if not key.startswith(prefix) or (after is not None and key <= after):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                out.append(KeyInfo(key, st.st_size, st.st_mtime, st.st_blocks * 512))
        return sorted(out)

    def delete(self, key: str) -> bool:
        path = self.file(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(path.parent)
        return True

    def open_writer(self, key: str) -> KeyWriter:
        """FileExistsError when ``key`` is there already."""
        return FileWriter(self.file(key))

    def sync(self, keys: Sequence[str]) -> None:
        dirs = set()
        for key in keys:
            path = self.file(key)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(path.parent)
        for d in dirs:
            fsync_dir(d)

    def local_path(self, key: str) -> pathlib.Path:
        return self.file(key)

    def locator(self) -> tuple[str, str]:
        return ("dir", os.fspath(self.root))

    def describe(self) -> str:
        return os.fspath(self.root)

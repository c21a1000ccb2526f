"""The storage-backend protocol: keys and bytes, nothing of packs, the index or the store
(docs/FORMAT.md "Object stores"; engine/packs/storage.py maps pack numbers to keys).

A key is a ``/``-separated relative path (``packs/01/00000300.pack``, ``commits/...``).
A backend gets, ranged-gets, puts, puts-if-absent, lists by prefix (with sizes) and
deletes objects, and streams one large object in through a ``KeyWriter`` (a multi-GB pack
never sits in memory). Errors are OSError: FileNotFoundError for a key that is not there,
FileExistsError for a put-if-absent (or a writer, on a backend that refuses it) whose key
is taken; callers translate them.
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Sequence
from typing import NamedTuple

from ..errors import FormatError


class KeyInfo(NamedTuple):
    """One listed object: its key, its size in bytes, when it was last written (Unix
    time) and the bytes it occupies where it is stored (allocated blocks of a file)."""

    key: str
    size: int
    modified: float
    stored: int


class KeyWriter(abc.ABC):
    """One object being streamed in, appended to and then made durable (``finish``).
    ``path`` is the local file that holds its bytes meanwhile (None: in memory)."""

    path: pathlib.Path | None

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    @abc.abstractmethod
    def writev(self, parts: Sequence[bytes | memoryview]) -> int:
        """Write ``parts`` back to back; return the bytes written."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Make the written bytes durable under the key (fsync of a file; a bucket starts
        its upload)."""

    def settle(self) -> None:
        """Wait until ``finish`` took effect (a bucket uploads in the background); raise
        what it failed with. A file is durable when ``finish`` returns."""
        return None

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Release the local file (a finished object stays readable by its key)."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Delete the object wherever it got to (abort, failed commit)."""


class ObjectBackend(abc.ABC):
    """Where the objects of one store live."""

    #: True when objects are reached by requests (ranged gets), not as local files.
    remote: bool = False
    #: True when writers on other hosts write here too (numbers are claimed by key).
    shared: bool = False

    @abc.abstractmethod
    def get(self, key: str, *, limit: int | None = None) -> bytes:
        """The object ``key``; with ``limit``, at most ``limit + 1`` of its bytes (the
        caller refuses more: a sparse file may claim any size)."""

    @abc.abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``key`` from ``offset`` (fewer only at its end)."""

    @abc.abstractmethod
    def head(self, key: str) -> KeyInfo: ...

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write ``key`` durably and atomically (a reader sees the old or the new bytes)."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create ``key`` durably and atomically, only if absent; FileExistsError if not."""

    @abc.abstractmethod
    def list(self, prefix: str, *, after: str | None = None) -> list[KeyInfo]:
        """Every object whose key starts with ``prefix`` (and sorts after ``after``), in
        key order."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key`` durably; False when it was not there (a bucket cannot tell:
        True)."""

    @abc.abstractmethod
    def open_writer(self, key: str) -> KeyWriter:
        """Stream a new object ``key`` in."""

    def sync(self, keys: Sequence[str]) -> None:
        """Make finished objects ``keys`` durable once more (a directory: fsync them and
        their directories; a bucket holds what it acknowledged)."""
        return None

    def local_path(self, key: str) -> pathlib.Path | None:
        """The local file that holds ``key`` (None: reach it by requests)."""
        return None

    def locator(self) -> tuple[str, str]:
        """(kind, where): what another process passes to ``engine.storage.attach`` to reach
        this backend (clients are never pickled)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the backend holds (background upload threads)."""
        return None

    def describe(self) -> str:
        return type(self).__name__


def check_key(key: str) -> str:
    """``key`` if it is a relative ``/`` path without ``..`` (no file outside the root)."""
    if not key or key.startswith("/") or ".." in key.split("/") or "\\" in key:
        raise FormatError(f"bad object key {key!r}")
    return key

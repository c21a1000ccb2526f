"""The pack-storage interface (docs/FORMAT.md "Pack files", "Object stores").

Packs are immutable once sealed: a ``WritablePack`` writes one (append, then ``finish`` makes
it durable where it lives: fsync for a directory, an upload for a bucket), and the
``PackStorage`` reads byte ranges of finished packs back, lists and deletes them. Errors
are OSError (FileNotFoundError for a pack that is not there, FileExistsError for a pack
number that is taken) so the engine's callers translate them as before.
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Sequence

from ..format import trailer


class WritablePack(abc.ABC):
    """One pack being written. ``path`` is the local file that holds its bytes meanwhile."""

    path: pathlib.Path

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    @abc.abstractmethod
    def writev(self, parts: Sequence[bytes | memoryview]) -> int:
        """Write ``parts`` back to back; return the bytes written."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Make the written bytes durable where the pack lives (after its trailer)."""

    def settle(self) -> None:
        """Wait until ``finish`` took effect (a bucket uploads in the background); raise
        what it failed with. Local files are durable when ``finish`` returns."""
        return None

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Release the local file (a finished pack stays readable through the storage)."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Delete the pack wherever it got to (abort, failed commit)."""


class PackStorage(abc.ABC):
    """The packs of one store."""

    #: True when packs live elsewhere than the index (ranged reads, no descriptors).
    remote: bool = False

    @abc.abstractmethod
    def create(self, n: int, *, meta: bool) -> WritablePack:
        """A sink for pack ``n``; FileExistsError when that number is taken."""

    @abc.abstractmethod
    def read(self, n: int, offset: int, length: int) -> bytes:
        """``length`` bytes of pack ``n`` from ``offset`` (fewer only at its end)."""

    @abc.abstractmethod
    def read_all(self, n: int) -> bytes: ...

    @abc.abstractmethod
    def size(self, n: int) -> int:
        """Bytes of pack ``n``; FileNotFoundError when it is not there."""

    @abc.abstractmethod
    def read_trailer(self, n: int) -> list[trailer.TrailerEntry]:
        """Entries of sealed pack ``n`` (CorruptObject without a valid trailer)."""

    @abc.abstractmethod
    def sizes(self) -> dict[int, int]:
        """Every pack there is (indexed or not) and its size in bytes as stored."""

    @abc.abstractmethod
    def delete(self, n: int) -> bool:
        """Delete pack ``n``; False when it was not there."""

    def modified(self, n: int) -> float:
        """Unix time pack ``n`` was last written (gc's grace period counts from it)."""
        raise NotImplementedError

    def sync_packs(self, ns: Sequence[int]) -> None:
        """Make finished packs ``ns`` durable once more before a commit names them (a
        directory: fsync them and their directories; a bucket holds what it acknowledged)."""
        return None

    def locator(self) -> tuple[str, str]:
        """(kind, where): what another process passes to ``engine.storage.attach`` to reach
        these packs (a rank of a distributed put; clients are never pickled)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the storage holds (background upload threads)."""
        return None

    def describe(self) -> str:
        return type(self).__name__

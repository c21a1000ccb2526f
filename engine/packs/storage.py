"""Packs over a storage backend (engine/storage): pack numbers as keys, trailers read by
ranged gets, pack sizes and ages from listings (docs/FORMAT.md "Pack files", "Object
stores"). The backend knows keys and bytes only; everything that knows what a pack is
lives here."""

from __future__ import annotations

import collections
import os
import pathlib
import re
import threading
from collections.abc import Sequence

from ..format import trailer
from ..format.names import pack_name
from ..storage import DirectoryBackend, KeyInfo, KeyWriter, ObjectBackend

PACKS = "packs/"
_KEY = re.compile(r"^packs/[0-9a-f]{2}/([0-9]{8})\.pack$")
_TRAILERS = 64  # trailers of recently read remote packs kept


def pack_key(n: int) -> str:
    return PACKS + pack_name(n)


def claim_key(n: int) -> str:
    return f"claims/{n:08d}"


def pack_number(key: str) -> int | None:
    m = _KEY.match(key)
    return int(m.group(1)) if m else None


class PackStorage:
    """The packs of one store, in ``backend``. Sealed packs are immutable; a number is
    never written twice: a directory refuses an existing file (O_EXCL), a backend other
    hosts write to is asked to create ``claims/N`` first (put-if-absent), kept for ever."""

    def __init__(self, backend: ObjectBackend) -> None:
        self.backend = backend
        self.remote = backend.remote
        self._trailers: collections.OrderedDict[int, list[trailer.TrailerEntry]] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    def create(self, n: int, *, meta: bool) -> KeyWriter:
        """A writer for pack ``n``; FileExistsError when that number is taken."""
        if self.backend.shared:
            self.backend.put_if_absent(claim_key(n), b"")
        return self.backend.open_writer(pack_key(n))

    def path(self, n: int) -> pathlib.Path | None:
        """The local file of pack ``n`` (None: reached by requests)."""
        return self.backend.local_path(pack_key(n))

    def read(self, n: int, offset: int, length: int) -> bytes:
        """``length`` bytes of pack ``n`` from ``offset`` (fewer only at its end)."""
        if length <= 0:
            return b""
        return self.backend.get_range(pack_key(n), offset, length)

    def read_all(self, n: int) -> bytes:
        return self.backend.get(pack_key(n))

    def size(self, n: int) -> int:
        """Bytes of pack ``n``; FileNotFoundError when it is not there."""
        return self.backend.head(pack_key(n)).size

    def modified(self, n: int) -> float:
        """Unix time pack ``n`` was last written (gc's grace period counts from it)."""
        return self.backend.head(pack_key(n)).modified

    def read_trailer(self, n: int) -> list[trailer.TrailerEntry]:
        """Entries of sealed pack ``n`` (CorruptObject without a valid trailer): its
        footer, then its entries, by two ranged reads. A remote pack's are cached."""
        if not self.remote:
            return self._read_trailer(n)
        with self._lock:
            cached = self._trailers.get(n)
            if cached is not None:
                self._trailers.move_to_end(n)
                return cached
        entries = self._read_trailer(n)
        with self._lock:
            self._trailers[n] = entries
            while len(self._trailers) > _TRAILERS:
                self._trailers.popitem(last=False)
        return entries

    def _read_trailer(self, n: int) -> list[trailer.TrailerEntry]:
        path = self.path(n)
        if path is not None:
            return trailer.read_trailer(path, name=pack_name(n))  # one open, not three
        return trailer.read_trailer_of(self.size(n), lambda off, ln: self.read(n, off, ln),
                                       name=pack_name(n))

    def listing(self) -> dict[int, KeyInfo]:
        """Every pack there is (indexed or not), by number."""
        out = {}
        for info in self.backend.list(PACKS):
            n = pack_number(info.key)
            if n is not None:
                out[n] = info
        return out

    def sizes(self) -> dict[int, int]:
        """Every pack there is and the bytes it occupies as stored (allocated blocks of a
        file, an object's size in a bucket)."""
        return {n: info.stored for n, info in self.listing().items()}

    def delete(self, n: int) -> bool:
        """Delete pack ``n``; False when it was not there (a bucket cannot tell)."""
        with self._lock:
            self._trailers.pop(n, None)
        return self.backend.delete(pack_key(n))

    def sync_packs(self, ns: Sequence[int]) -> None:
        """Make finished packs ``ns`` durable once more before a commit names them."""
        self.backend.sync([pack_key(n) for n in ns])

    def locator(self) -> tuple[str, str]:
        return self.backend.locator()

    def close(self) -> None:
        self.backend.close()

    def describe(self) -> str:
        return self.backend.describe()


def as_storage(where: str | os.PathLike | PackStorage | ObjectBackend) -> PackStorage:
    """``where`` as a PackStorage: a backend's packs, or a store directory's local packs."""
    if isinstance(where, PackStorage):
        return where
    if isinstance(where, ObjectBackend):
        return PackStorage(where)
    return PackStorage(DirectoryBackend(pathlib.Path(where).absolute()))

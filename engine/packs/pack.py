"""Pack files: appending and sealing them, reading records back, scanning them for repair.

Layout and ordering rules: docs/FORMAT.md "Pack files", "Trailer", "Write ordering".
A pack is written once by one writer (under the writer lock), sealed with a trailer,
fsync'ed, and never modified after the index transaction that lists it commits.
"""

from __future__ import annotations

import collections
import os
import pathlib
import threading
from collections.abc import Sequence

from ..errors import CorruptObject
from ..format import records as fmt
from ..format import trailer
from ..format.names import (  # noqa: F401 - pack names, used with the packs
    list_pack_files,
    pack_name,
    pack_numbers,
    pack_path,
)
from ..fs.fileio import fsync_dir, pread_exact
from ..fs.writeback import Writeback
from .storage import PackStorage, as_storage


def record_length(record: bytes | Sequence[bytes | memoryview]) -> int:
    if isinstance(record, (bytes, bytearray, memoryview)):
        return len(record)
    return sum(len(part) for part in record)


class PackFile:
    """One pack being written: header, appended records, then a trailer at seal().

    ``root`` is a store directory (its local packs) or any PackStorage (e.g. S3, where the
    bytes are staged in a local file and uploaded by ``sync``)."""

    def __init__(self, root: pathlib.Path | PackStorage, n: int, *, meta: bool) -> None:
        self.number = n
        self.meta = meta
        self._sink = as_storage(root).create(n, meta=meta)  # FileExistsError: number taken
        self.path = self._sink.path
        self.entries: list[trailer.TrailerEntry] = []
        self.size = 0
        self.live = 0  # bytes of object records (roots snapshots are never live)
        self.sealed = False
        self._writeback = Writeback(self._sink)
        self._write(fmt.PackHeader(fmt.FORMAT_VERSION, meta, n).pack())

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        self._sink.write(data)
        self.size += len(data)

    def append(self, record: bytes | Sequence[bytes | memoryview], rtype: int, oid: bytes) -> int:
        """Append a record, given whole or as parts written back to back."""
        offset = self.size
        if isinstance(record, (bytes, bytearray, memoryview)):
            self._write(record)
            length = len(record)
        else:
            length = self._sink.writev(record)
            self.size += length
        self.entries.append(trailer.TrailerEntry(offset, length, rtype, oid))
        if rtype == fmt.RECORD_OBJECT:
            self.live += length
        self._writeback.advance(self.size)  # the disk works while the writer computes
        return offset

    @property
    def objects(self) -> int:
        return sum(1 for e in self.entries if e.rtype == fmt.RECORD_OBJECT)

    def seal(self) -> None:
        """Write the trailer (records stay unsynced until ``sync``)."""
        if not self.sealed:
            self._write(trailer.encode_trailer(self.entries, self.size))
            self.sealed = True

    def sync(self) -> None:
        """Make the pack durable where it lives (fsync; on S3 the upload)."""
        self._sink.finish()

    def settle(self) -> None:
        """Wait for ``sync`` to take effect (an upload runs in the background)."""
        self._sink.settle()

    @property
    def closed(self) -> bool:
        return self._sink.closed

    def close(self) -> None:
        self._sink.close()

    def discard(self, *, keep_uploaded: bool = False) -> None:
        """Delete the pack; ``keep_uploaded`` keeps a copy already in a bucket (a commit
        that may have been published names it: gc reclaims it if not)."""
        if keep_uploaded:
            self._sink.close()
        else:
            self._sink.discard()


class PackSet:
    """The open data pack and meta pack of one transaction, rolled at ``target_size``."""

    def __init__(self, root: pathlib.Path | PackStorage, next_number: int,
                 target_size: int) -> None:
        self._root = as_storage(root)
        self._next = next_number
        self._target = target_size
        self._open: dict[bool, PackFile] = {}
        self.files: list[PackFile] = []

    def _new_pack(self, meta: bool) -> PackFile:
        while True:
            n, self._next = self._next, self._next + 1
            try:
                pf = PackFile(self._root, n, meta=meta)
            except FileExistsError:  # a crash leftover holds this number: skip it
                continue
            self.files.append(pf)
            return pf

    def append(
        self, record: bytes | Sequence[bytes | memoryview], rtype: int, oid: bytes, *, meta: bool
    ) -> tuple[int, int]:
        """Append a record (whole or as parts); return (pack number, offset)."""
        pf = self._open.get(meta)
        length = record_length(record)
        if pf is not None and pf.entries and pf.size + length > self._target:
            # Finish a full pack now, so a huge transaction never holds many descriptors.
            pf.seal()
            pf.sync()
            pf.close()
            pf = None
        if pf is None:
            pf = self._open[meta] = self._new_pack(meta)
        return pf.number, pf.append(record, rtype, oid)

    @property
    def next_number(self) -> int:
        return self._next

    def seal_and_sync(self) -> None:
        """Seal every pack, fsync them, then fsync the directories that hold them."""
        for pf in self.files:
            if not pf.closed:
                pf.seal()
                pf.sync()
        for pf in self.files:
            pf.settle()  # uploads of rolled packs ran while later records were appended
        for d in {pf.path.parent for pf in self.files if pf.path is not None}:
            fsync_dir(d)

    def close(self) -> None:
        for pf in self.files:
            pf.close()

    def discard(self, *, keep_uploaded: bool = False) -> None:
        for pf in self.files:
            pf.discard(keep_uploaded=keep_uploaded)
        self.files.clear()
        self._open.clear()


class _OpenPack:
    __slots__ = ("fd", "users", "evicted")

    def __init__(self, fd: int) -> None:
        self.fd, self.users, self.evicted = fd, 0, False


class PackReaders:
    """Thread-safe pread access to packs through a small LRU of open descriptors. One is
    closed only when out of the cache AND unused: closing it under a concurrent pread
    could let the number be reused for another file and feed that reader foreign bytes."""

    def __init__(self, root: pathlib.Path | PackStorage, *, max_open: int = 64) -> None:
        storage = as_storage(root)
        # Remote packs are read by ranged requests: no descriptors to cache.
        self._remote: PackStorage | None = storage if storage.remote else None
        self._storage = storage
        self._max = max_open
        self._open: collections.OrderedDict[int, _OpenPack] = collections.OrderedDict()
        # Each pack's file name: a grouped restore reads ~150 packs a window, past the
        # LRU, and building the path anew took more than the open (engine/store/batchread.py)
        self._paths: dict[int, str] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _checkout(self, n: int) -> _OpenPack:
        with self._lock:
            entry = self._open.get(n)
            if entry is not None:
                self._open.move_to_end(n)
                entry.users += 1
                return entry
        path = self._paths.get(n)
        if path is None:
            local = self._storage.path(n)
            assert local is not None  # a storage without local files is remote
            path = self._paths[n] = os.fspath(local)
        fd = os.open(path, os.O_RDONLY)  # FileNotFoundError propagates
        with self._lock:
            entry = self._open.get(n)
            if entry is None:
                entry = self._open[n] = _OpenPack(fd)
                fd = -1
            entry.users += 1
            while len(self._open) > self._max:
                _, old = self._open.popitem(last=False)
                self._evict(old)
        if fd >= 0:
            os.close(fd)  # another thread opened it first
        return entry

    def _evict(self, entry: _OpenPack) -> None:
        """With the lock held: close now, or when its last reader is done."""
        entry.evicted = True
        if entry.users == 0:
            os.close(entry.fd)

    def _checkin(self, entry: _OpenPack) -> None:
        with self._lock:
            entry.users -= 1
            if entry.evicted and entry.users == 0:
                os.close(entry.fd)

    def read(self, n: int, offset: int, length: int) -> bytes:
        if self._remote is not None:
            data = self._remote.read(n, offset, length)
            if len(data) != length:
                raise CorruptObject(f"pack {pack_name(n)} offset {offset}: truncated "
                                    f"({len(data)} of {length} bytes)", pack=pack_name(n),
                                    offset=offset)
            return data
        entry = self._checkout(n)
        try:
            data = pread_exact(entry.fd, length, offset)
        finally:
            self._checkin(entry)
        if len(data) != length:
            raise CorruptObject(
                f"pack {pack_name(n)} offset {offset}: truncated ({len(data)} of {length} bytes)",
                pack=pack_name(n), offset=offset,
            )
        return data

    def readv(self, n: int, offset: int, bufs: Sequence[memoryview]) -> bool:
        """Fill ``bufs`` back to back from ``offset`` of pack ``n`` (preadv into the
        caller's memory, no fresh buffer). False for a remote pack: use ``read``.
        FileNotFoundError when the pack is gone; CorruptObject on a short read."""
        if self._remote is not None:
            return False
        views = [memoryview(b).cast("B") for b in bufs if len(b)]
        want = sum(len(v) for v in views)
        entry = self._checkout(n)
        try:
            pos, got = offset, 0
            while views:
                k = os.preadv(entry.fd, views[:1024], pos)  # IOV_MAX
                if k == 0:
                    break
                got += k
                pos += k
                while views and k >= len(views[0]):
                    k -= len(views[0])
                    views.pop(0)
                if views and k:
                    views[0] = views[0][k:]
        finally:
            self._checkin(entry)
        if got != want:
            raise CorruptObject(
                f"pack {pack_name(n)} offset {offset}: truncated ({got} of {want} bytes)",
                pack=pack_name(n), offset=offset,
            )
        return True

    def read_spans(self, spans: Sequence[tuple[int, int, int]], *, advise: bool = False
                   ) -> list[bytes | Exception]:
        """``read(n, offset, length)`` of each (n, offset, length) of ``spans``, in their
        order, each pack opened once for all its spans (one ``read`` a span opened a pack
        per span once more packs than the LRU holds are read in turn: a grouped restore's
        window reads ~150). With ``advise``, every span is hinted (POSIX_FADV_WILLNEED)
        before the first is read, so a cold disk reads them together instead of one
        after another. A span that fails holds its error (FileNotFoundError,
        CorruptObject, OSError) in its place; the others are read."""
        if self._remote is not None:
            out: list[bytes | Exception] = []
            for n, offset, length in spans:
                try:
                    out.append(self.read(n, offset, length))
                except Exception as exc:  # noqa: BLE001 - the caller's to report
                    out.append(exc)
            return out
        held: dict[int, _OpenPack | Exception] = {}
        try:
            for n, _, _ in spans:
                if n not in held:
                    try:
                        held[n] = self._checkout(n)
                    except OSError as exc:
                        held[n] = exc
            if advise and hasattr(os, "posix_fadvise"):
                for n, offset, length in spans:
                    entry = held[n]
                    if isinstance(entry, _OpenPack):
                        try:
                            os.posix_fadvise(entry.fd, offset, length,
                                             os.POSIX_FADV_WILLNEED)
                        except OSError:
                            pass  # a hint only
            out = []
            for n, offset, length in spans:
                entry = held[n]
                if not isinstance(entry, _OpenPack):
                    out.append(entry)
                    continue
                try:
                    data = pread_exact(entry.fd, length, offset)
                except Exception as exc:  # noqa: BLE001 - an odd offset too: the caller's
                    out.append(exc)
                    continue
                if len(data) != length:
                    out.append(CorruptObject(
                        f"pack {pack_name(n)} offset {offset}: truncated ({len(data)} of "
                        f"{length} bytes)", pack=pack_name(n), offset=offset))
                    continue
                out.append(data)
            return out
        finally:
            for entry in held.values():
                if isinstance(entry, _OpenPack):
                    self._checkin(entry)

    def advise(self, n: int, spans: Sequence[tuple[int, int]]) -> None:
        """Read-ahead hint (POSIX_FADV_WILLNEED) for (offset, length) spans of pack ``n``;
        a pack that is gone or remote is skipped."""
        if self._remote is not None or self._closed or not hasattr(os, "posix_fadvise"):
            return
        try:
            entry = self._checkout(n)
        except OSError:
            return
        try:
            for offset, length in spans:
                os.posix_fadvise(entry.fd, offset, length, os.POSIX_FADV_WILLNEED)
        finally:
            self._checkin(entry)

    def forget(self, n: int) -> None:
        with self._lock:
            entry = self._open.pop(n, None)
            if entry is not None:
                self._evict(entry)

    def close(self) -> None:
        with self._lock:
            self._closed = True  # a late advise() must not cache a descriptor again
            entries, self._open = list(self._open.values()), collections.OrderedDict()
            for entry in entries:
                self._evict(entry)


# Scanning (repair, gc leftovers) lives in engine/packs/scan.py; re-exported here.
from .scan import (  # noqa: E402,F401
    ScannedRecord,
    read_pack_header,
    read_trailer,
    scan_records,
)

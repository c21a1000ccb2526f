"""Reading records by location, without the index: the rank side of a distributed store
(docs/FORMAT.md "Distributed commit").

A non-coordinator rank never opens LMDB; it learns ``RecordLocation``s from the
coordinator (``PackStore.locate`` / ``locate_closure``) and reads the records straight
from the packs through a ``PackStorage`` (pread of a file; a ranged GET from a bucket),
checked exactly like the store's own reads (``core.read_checked``:
checksum, bounded decompression, id and kind). A pack that is gone (a gc compacted it
since the location was learnt) raises ``PackMoved``: ask the coordinator again.

``LocatedObjects`` wraps a reader and a set of locations as a read-only
``ObjectStore``, so code that restores through an ObjectStore runs unchanged on a rank.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import cast

import zstandard

from ..api import (
    Object,
    ObjectInfo,
    ObjectStore,
    Problem,
    ProgressFn,
    RepairReport,
    Stats,
    StoreGCReport,
    StoreVerifyReport,
    Writer,
)
from ..errors import CorruptObject, ObjectNotFound, PackMoved, ReadOnly, StoreClosed
from ..format.ids import check_id, check_root_name, hexid
from ..format.location import RecordLocation
from ..packs.pack import PackReaders, as_storage, pack_name
from ..packs.storage import PackStorage
from ..storage import ObjectBackend
from .core import advise, read_checked, read_raw_into


class LocatedReader:
    """Checked reads of records by location from ``storage`` (a PackStorage, or a store
    directory: its ``packs``). Thread-safe."""

    def __init__(self, storage: str | os.PathLike | PackStorage | ObjectBackend) -> None:
        self.storage = as_storage(storage)
        self.path = self.storage.describe()
        self._readers = PackReaders(self.storage)
        self._local = threading.local()
        self._closed = False

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return cast(zstandard.ZstdDecompressor, dctx)

    def read(self, loc: RecordLocation) -> Object:
        """The object at ``loc``, id-checked. PackMoved when its pack is gone."""
        if self._closed:
            raise StoreClosed(f"located reader of {self.path} is closed")
        if not isinstance(loc, RecordLocation):
            raise TypeError(f"expected a RecordLocation, got {type(loc).__name__}")
        obj = read_checked(self._readers, loc.oid, loc.pack, loc.offset, loc.length,
                           loc.kind, self._dctx(), raw_len=loc.raw_len)
        if obj is None:
            self._readers.forget(loc.pack)
            raise PackMoved(f"object {hexid(loc.oid)}: pack {pack_name(loc.pack)} is gone "
                            "(gc moved its records); locate it again", oid=loc.oid)
        if obj.refs != loc.refs:
            raise CorruptObject(f"object {hexid(loc.oid)}: its location names other refs "
                                "than its record", oid=loc.oid, pack=pack_name(loc.pack),
                                offset=loc.offset)
        return obj

    def get_many(self, locs: Iterable[RecordLocation]) -> Iterator[Object]:
        for loc in locs:
            yield self.read(loc)

    def read_into(self, loc: RecordLocation, kind: int, prefix: int, out: memoryview, *,
                  id_check: bool = True, fallback: bool = False) -> bytes | Object | None:
        """``ObjectStore.get_into`` at ``loc``: a raw record lands in ``out`` with one
        preadv, checked as the store's own direct read (a rank restoring into fresh memory
        otherwise paid a payload-sized buffer and a copy per block)."""
        if self._closed:
            raise StoreClosed(f"located reader of {self.path} is closed")
        try:
            got = read_raw_into(self._readers, loc.oid, loc, kind, prefix, out,
                                id_check=id_check)
        except FileNotFoundError:
            self._readers.forget(loc.pack)
            raise PackMoved(f"object {hexid(loc.oid)}: pack {pack_name(loc.pack)} is gone "
                            "(gc moved its records); locate it again", oid=loc.oid) from None
        if got is None and fallback:
            return self.read(loc)
        return got

    def advise(self, locs: Iterable[RecordLocation]) -> None:
        """Read-ahead hint for the records at ``locs``."""
        advise(self._readers, locs, lambda: self._closed)

    def close(self) -> None:
        self._closed = True
        self._readers.close()

    def __enter__(self) -> LocatedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocatedObjects(ObjectStore):
    """A read-only ObjectStore serving exactly the objects of ``locations`` (and the
    ``roots`` given, if any) through ``reader``. Writer, gc and repair raise ReadOnly.
    Closing it does not close the reader (the caller owns it)."""

    def __init__(self, reader: LocatedReader, locations: Mapping[bytes, RecordLocation],
                 roots: Mapping[str, bytes] | None = None) -> None:
        self._reader = reader
        self._locs = dict(locations)
        self._roots = dict(roots or {})
        self._closed = False

    def _loc(self, oid: bytes) -> RecordLocation:
        if self._closed:
            raise StoreClosed("located objects view is closed")
        check_id(oid)
        loc = self._locs.get(bytes(oid))
        if loc is None:
            raise ObjectNotFound(f"object {hexid(oid)} not found (not among the located "
                                 "objects)", oid=bytes(oid))
        return loc

    def get(self, oid: bytes) -> Object:
        return self._reader.read(self._loc(oid))

    def get_many(self, oids: Iterable[bytes]) -> Iterator[Object]:
        for oid in oids:
            yield self._reader.read(self._loc(oid))

    def get_into(self, oid: bytes, kind: int, prefix: int, out: memoryview, *,
                 id_check: bool = True, fallback: bool = False) -> bytes | Object | None:
        return self._reader.read_into(self._loc(oid), kind, prefix, out, id_check=id_check,
                                      fallback=fallback)

    def locate(self, oids: Iterable[bytes]) -> dict[bytes, RecordLocation]:
        if self._closed:
            raise StoreClosed("located objects view is closed")
        return {bytes(o): self._locs[bytes(o)] for o in oids if bytes(o) in self._locs}

    def locate_closure(self, oids: Iterable[bytes]) -> dict[bytes, RecordLocation]:
        """``locate`` of ``oids`` and all they reach, among the located objects."""
        found = self.locate(oids)
        todo = list(found.values())
        while todo:
            for ref in todo.pop().refs:
                loc = self._locs.get(ref)
                if loc is not None and ref not in found:
                    found[ref] = loc
                    todo.append(loc)
        return found

    def prefetch(self, oids: Iterable[bytes]) -> None:
        """Read ahead the records of ``oids`` and all they reach (a rank's cold restore
        otherwise read each block as the decode asked for it)."""
        self.prefetch_at(self.locate_closure(oids).values())

    def prefetch_at(self, locs: Iterable[RecordLocation]) -> None:
        if not self._closed:
            self._reader.advise(locs)

    def info(self, oid: bytes) -> ObjectInfo:
        loc = self._loc(oid)
        return ObjectInfo(loc.kind, loc.refs, loc.raw_len, loc.length, loc.meta)

    def has(self, oid: bytes) -> bool:
        if self._closed:
            raise StoreClosed("located objects view is closed")
        return bytes(oid) in self._locs

    def locations(self) -> dict[bytes, RecordLocation]:
        return dict(self._locs)

    def root(self, name: str) -> bytes | None:
        check_root_name(name)
        return self._roots.get(name)

    def roots(self) -> dict[str, bytes]:
        return dict(self._roots)

    def writer(self, *, timeout: float | None = 0.0) -> Writer:
        raise ReadOnly("writer() on located objects (a rank's read-only view)")

    def gc(self, *, threshold: float = 0.25, timeout: float | None = 0.0,
           progress: ProgressFn | None = None) -> StoreGCReport:
        raise ReadOnly("gc() on located objects (a rank's read-only view)")

    def repair(self, *, dry_run: bool = False) -> RepairReport:
        raise ReadOnly("repair() on located objects (a rank's read-only view)")

    def verify(self, *, deep: bool = False, roots: Iterable[str] | None = None,
               progress: ProgressFn | None = None) -> StoreVerifyReport:
        """Structure: every ref of a located object is located too. Deep: read and
        id-check every located object. ``roots`` limits nothing here (all are checked)."""
        problems: list[Problem] = []
        nbytes = 0
        for loc in self._locs.values():
            for ref in loc.refs:
                if ref not in self._locs:
                    problems.append(Problem("missing", f"ref {hexid(ref)} of "
                                            f"{hexid(loc.oid)} is not located", oid=ref))
            if deep:
                try:
                    nbytes += len(self._reader.read(loc).payload)
                except ObjectNotFound as exc:
                    problems.append(Problem("missing-pack", str(exc), oid=loc.oid,
                                            pack=pack_name(loc.pack), offset=loc.offset))
                except CorruptObject as exc:
                    problems.append(Problem("corrupt", str(exc), oid=loc.oid,
                                            pack=pack_name(loc.pack), offset=loc.offset))
        return StoreVerifyReport(not problems, tuple(problems), len(self._locs), nbytes)

    def stats(self) -> Stats:
        logical = sum(loc.raw_len for loc in self._locs.values())
        packs = len({loc.pack for loc in self._locs.values()})
        return Stats(len(self._locs), logical, 0, packs, len(self._roots))

    def close(self) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"LocatedObjects({self._reader.path!r}, {len(self._locs)} objects)"

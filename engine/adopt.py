"""Adoption: a coordinator's writer publishes records that ranks wrote into reserved packs
(docs/FORMAT.md "Distributed commit").

``PackWriter.adopt(locs)`` hands the locations here. Each one is checked against what is
on disk before anything can be published: its pack is sealed (a valid trailer), is a
reserved number no index lists, and not one of the writer's own; the trailer holds a record
of that id, offset and length; the record header (read, with its refs, by one small
pread) says the same kind, refs, raw length, and the pack header the same meta flag. The
refs the index will hold must be the record's: gc marks by them, so a wrong list would
sweep live data. Ids the store (or this writer) holds already are skipped and counted
reused. At commit the writer checks that every adopted ref resolves, fsyncs the adopted
packs and their directories before its own roots record is sealed, and publishes the
entries and pack accounting in its ONE index transaction, exactly as if it had written
the packs itself (a pack's ``total`` counts every object record its trailer lists).
"""

from __future__ import annotations

import os
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import format as fmt
from . import index as ix
from .errors import CorruptObject, ObjectNotFound, StoreError
from .fileio import fsync_dir, store_error
from .ids import ID_SIZE, hexid
from .location import RecordLocation
from .pack import pack_name, pack_path, read_trailer

if TYPE_CHECKING:
    from .core import StoreCore


@dataclass
class _Pack:
    size: int
    total: int                      # bytes of object records its trailer lists
    meta: bool
    trailer: dict[int, fmt.TrailerEntry]  # by offset
    live: int = 0
    count: int = 0


class Adoption:
    """The records one writer adopts; not thread-safe (the writer serializes calls)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self.locs: dict[bytes, RecordLocation] = {}
        self.packs: dict[int, _Pack] = {}
        self.named: set[int] = set()  # every pack a location named, adopted or not
        self.reused = 0

    @property
    def bytes_new(self) -> int:
        return sum(loc.length for loc in self.locs.values())

    @property
    def payload_new(self) -> int:
        return sum(loc.raw_len for loc in self.locs.values())

    def add(self, locs: Iterable[RecordLocation], *, pending: Container[bytes],
            own_packs: set[int]) -> int:
        """Check and take ``locs`` (all or none of them); ``pending`` are the writer's own
        new ids, ``own_packs`` its pack numbers. Returns how many became new."""
        batch = list(locs)
        for loc in batch:
            if not isinstance(loc, RecordLocation):
                raise TypeError(f"adopt takes RecordLocations, got {type(loc).__name__}")
        self.named.update(loc.pack for loc in batch)
        index = self._core.index
        wanted = sorted({loc.pack for loc in batch} - set(self.packs))

        def state(txn: ix.Txn) -> tuple[set[bytes], set[int], int]:
            have = {loc.oid for loc in batch if txn.get(loc.oid, db=index.objects) is not None}
            listed = {n for n in wanted if txn.get(ix.pack_key(n), db=index.packs) is not None}
            return have, listed, ix.get_u64(txn, index.meta, ix.META_NEXT_PACK)

        have, listed, next_pack = index.read(state)
        fresh: dict[bytes, RecordLocation] = {}
        reused = 0
        for loc in batch:
            if loc.oid in have or loc.oid in pending or loc.oid in self.locs or loc.oid in fresh:
                reused += 1
            else:
                fresh[loc.oid] = loc
        packs: dict[int, _Pack] = {}
        for n in sorted({loc.pack for loc in fresh.values()} - set(self.packs)):
            name = pack_name(n)
            if n in listed or n in own_packs or n >= next_pack:
                raise StoreError(f"cannot adopt pack {name}: it is not a reserved pack of "
                                 "a distributed put (listed in the index, this writer's "
                                 "own, or never reserved); nothing was adopted")
            packs[n] = self._open_pack(n)
        by_pack: dict[int, list[RecordLocation]] = {}
        for loc in fresh.values():
            by_pack.setdefault(loc.pack, []).append(loc)
        for n, group in sorted(by_pack.items()):
            info = packs.get(n) or self.packs[n]
            self._check_records(n, info, group)
        # All checked: take them.
        self.packs.update(packs)
        for loc in fresh.values():
            p = self.packs[loc.pack]
            p.live += loc.length
            p.count += 1
        self.locs.update(fresh)
        self.reused += reused
        return len(fresh)

    def _open_pack(self, n: int) -> _Pack:
        path = pack_path(self._core.path, n)
        name = pack_name(n)
        try:
            entries = read_trailer(path, name=name)  # CorruptObject when unsealed
            header = _read_at(path, 0, fmt.PACK_HEADER.size)
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise ObjectNotFound(f"cannot adopt pack {name}: no such file") from None
        except CorruptObject as exc:
            raise CorruptObject(f"cannot adopt pack {name}: it is not sealed ({exc}); a "
                                "rank reports its locations only after sealing",
                                pack=name, offset=exc.offset) from exc
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc
        meta = fmt.PackHeader.unpack(header, pack=name).meta
        if fmt.PackHeader.unpack(header, pack=name).pack_no != n:
            raise CorruptObject(f"cannot adopt pack {name}: its header names another "
                                "pack number", pack=name, offset=0)
        total = sum(e.length for e in entries if e.rtype == fmt.RECORD_OBJECT)
        return _Pack(size, total, meta, {e.offset: e for e in entries})

    def _check_records(self, n: int, info: _Pack, group: list[RecordLocation]) -> None:
        name = pack_name(n)
        path = pack_path(self._core.path, n)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc
        try:
            for loc in group:
                t = info.trailer.get(loc.offset)
                where = f"object {hexid(loc.oid)} at pack {name} offset {loc.offset}"
                if (t is None or t.oid != loc.oid or t.length != loc.length
                        or t.rtype != fmt.RECORD_OBJECT):
                    raise CorruptObject(f"cannot adopt {where}: the pack's trailer lists "
                                        "no such record", oid=loc.oid, pack=name,
                                        offset=loc.offset)
                if loc.meta != info.meta:
                    raise CorruptObject(f"cannot adopt {where}: meta={loc.meta} but the "
                                        f"pack's header says meta={info.meta}", oid=loc.oid,
                                        pack=name, offset=loc.offset)
                size = fmt.RECORD_HEADER.size + ID_SIZE * len(loc.refs)
                buf = os.pread(fd, size, loc.offset)
                h = fmt.RecordHeader.unpack(buf, 0, pack=name)
                refs = tuple(buf[fmt.RECORD_HEADER.size + i * ID_SIZE:
                                 fmt.RECORD_HEADER.size + (i + 1) * ID_SIZE]
                             for i in range(h.nrefs)) if h.nrefs == len(loc.refs) else None
                if (h.oid != loc.oid or h.rtype != fmt.RECORD_OBJECT or h.kind != loc.kind
                        or refs != loc.refs
                        or h.raw_len != loc.raw_len or h.length != loc.length):
                    raise CorruptObject(f"cannot adopt {where}: the record's header (kind, "
                                        "refs, lengths) differs from the location",
                                        oid=loc.oid, pack=name, offset=loc.offset)
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc
        finally:
            os.close(fd)

    def check_refs(self, pending: Container[bytes]) -> None:
        """Every ref of every adopted record resolves: indexed, put or adopted
        (ObjectNotFound otherwise; the writer then publishes nothing)."""
        wanted = {r for loc in self.locs.values() for r in loc.refs
                  if r not in self.locs and r not in pending}
        if not wanted:
            return
        index = self._core.index
        absent = index.read(lambda t: [r for r in wanted
                                       if t.get(r, db=index.objects) is None])
        if absent:
            of = next(loc.oid for loc in self.locs.values() if absent[0] in loc.refs)
            raise ObjectNotFound(f"adopted object {hexid(of)} refers to {hexid(absent[0])}, "
                                 f"which is neither stored, put nor adopted ({len(absent)} "
                                 "dangling refs); nothing was published", oid=absent[0])

    def sync(self) -> None:
        """fsync every adopted pack and its directory (ranks did; this makes it hold
        whatever a rank's filesystem promised) before the commit's roots record."""
        dirs = set()
        for n in self.packs:
            path = pack_path(self._core.path, n)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(path.parent)
        for d in dirs:
            fsync_dir(d)

    def publish(self, txn: ix.Txn) -> None:
        """Inside the writer's publishing transaction."""
        index = self._core.index
        for oid, loc in self.locs.items():
            entry = ix.ObjectEntry(loc.pack, loc.offset, loc.length, loc.kind, loc.raw_len,
                                   loc.meta, loc.refs)
            txn.put(oid, entry.encode(oid), db=index.objects)
        for n, p in self.packs.items():
            packed = ix.PackEntry(p.size, p.total, p.live, p.meta, p.count)
            txn.put(ix.pack_key(n), packed.encode(), db=index.packs)


def _read_at(path: os.PathLike, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)

"""Adoption: a coordinator's writer publishes records that ranks wrote into reserved packs
(docs/FORMAT.md "Distributed commit").

``PackWriter.adopt(locs)`` hands the locations here. Each one is checked against what the
store's ``PackStorage`` holds before anything can be published: its pack is sealed (a
valid trailer), is a reserved number no index lists, and not one of the writer's own; the
trailer holds a record of that id, offset and length; the record header (read, with its
refs, by one small pread; from a bucket by ranged GETs, 16 in flight, each covering
the headers of a run of small records) says the same kind, refs, raw length, and the
pack header the same meta flag. The
refs the index will hold must be the record's: gc marks by them, so a wrong list would
sweep live data. Ids the store (or this writer) holds already are skipped and counted
reused. At commit the writer checks that every adopted ref resolves, fsyncs the adopted
packs and their directories before its own roots record is sealed, and publishes the
entries and pack accounting in its ONE index transaction, exactly as if it had written
the packs itself (a pack's ``total`` counts every object record its trailer lists).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import CorruptObject, ObjectNotFound, StoreError
from ..format import records as fmt
from ..format import trailer
from ..format.commitdoc import PackDoc
from ..format.ids import ID_SIZE, hexid
from ..format.location import RecordLocation
from ..fs.fileio import store_error
from ..index import db as ix
from ..index.commits import pack_doc
from ..packs.pack import pack_name

_REMOTE_READS = 16  # ranged GETs of record headers in flight at once
_BATCH_BYTES = 1 << 20  # one GET covers the headers of small records within 1 MiB,
_GAP_BYTES = 64 << 10   # skipping at most this much payload between two of them

if TYPE_CHECKING:
    from .core import PackStoreState


@dataclass
class _Pack:
    size: int
    total: int                      # bytes of object records its trailer lists
    meta: bool
    trailer: dict[int, trailer.TrailerEntry]  # by offset
    modified: float                 # unix time it was last written (its upload)
    live: int = 0
    count: int = 0


class Adoption:
    """The records one writer adopts; not thread-safe (the writer serializes calls)."""

    def __init__(self, core: PackStoreState) -> None:
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
            return have, listed, ix.get_next_pack(txn, index.meta)

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

    @property
    def oldest(self) -> float | None:
        """When the oldest adopted pack was written: a bucket commit's age counts from it."""
        return min((p.modified for p in self.packs.values()), default=None)

    def _open_pack(self, n: int) -> _Pack:
        storage = self._core.storage
        name = pack_name(n)
        try:
            entries = storage.read_trailer(n)  # CorruptObject when unsealed
            header = storage.read(n, 0, fmt.PACK_HEADER.size)
            size = storage.size(n)
            modified = storage.modified(n)
        except FileNotFoundError:
            raise ObjectNotFound(f"cannot adopt pack {name}: no such pack") from None
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
        return _Pack(size, total, meta, {e.offset: e for e in entries}, modified)

    def _check_records(self, n: int, info: _Pack, group: list[RecordLocation]) -> None:
        name = pack_name(n)
        storage = self._core.storage
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
        try:
            path = storage.path(n)
            if path is not None:
                fd = os.open(path, os.O_RDONLY)
                try:
                    for loc in group:
                        _check_header(name, loc, os.pread(fd, _header_size(loc), loc.offset))
                finally:
                    os.close(fd)
                return
            batches = _batches(group)

            def fetch(batch: list[RecordLocation]) -> bytes:
                start = batch[0].offset
                return storage.read(n, start, batch[-1].offset + _header_size(batch[-1])
                                    - start)

            with concurrent.futures.ThreadPoolExecutor(_REMOTE_READS) as pool:
                for batch, buf in zip(batches, pool.map(fetch, batches)):
                    start = batch[0].offset
                    for loc in batch:
                        at = loc.offset - start
                        _check_header(name, loc, buf[at:at + _header_size(loc)])
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc

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
        """Make every adopted pack durable once more (a directory: fsync the packs and
        their directories, so it holds whatever a rank's filesystem promised) before the
        commit's roots record."""
        self._core.storage.sync_packs(sorted(self.packs))

    def pack_docs(self) -> tuple[PackDoc, ...]:
        """The adopted packs and entries as a commit document lists them
        (engine/store/commit/bucket.py): other caches learn them from it alone."""
        by_pack: dict[int, list[tuple[bytes, ix.ObjectEntry]]] = {}
        for oid, entry in self.entries().items():
            by_pack.setdefault(entry.pack, []).append((oid, entry))
        return tuple(pack_doc(n, p.size, p.meta, by_pack.get(n, []))
                     for n, p in sorted(self.packs.items()))

    def entries(self) -> dict[bytes, ix.ObjectEntry]:
        """The index entries of the adopted records, for the writer's commit."""
        return {oid: ix.ObjectEntry(loc.pack, loc.offset, loc.length, loc.kind, loc.raw_len,
                                    loc.meta, loc.refs) for oid, loc in self.locs.items()}

    def pack_entries(self) -> dict[int, ix.PackEntry]:
        return {n: ix.PackEntry(p.size, p.total, p.live, p.meta, p.count)
                for n, p in self.packs.items()}


def _batches(group: list[RecordLocation]) -> list[list[RecordLocation]]:
    """Records by offset, in runs whose headers one ranged GET covers: a record joins the
    run when the bytes skipped to reach its header (the previous record's payload) are at
    most ``_GAP_BYTES`` and the GET stays within ``_BATCH_BYTES``. Small records cost one
    request per run, not per record; large ones one small GET each, so adoption never
    downloads what the ranks uploaded."""
    out: list[list[RecordLocation]] = []
    for loc in sorted(group, key=lambda x: x.offset):
        if out:
            last = out[-1][-1]
            gap = loc.offset - (last.offset + _header_size(last))
            if gap <= _GAP_BYTES and (loc.offset + _header_size(loc) - out[-1][0].offset
                                      <= _BATCH_BYTES):
                out[-1].append(loc)
                continue
        out.append([loc])
    return out


def _header_size(loc: RecordLocation) -> int:
    return fmt.RECORD_HEADER.size + ID_SIZE * len(loc.refs)


def _check_header(name: str, loc: RecordLocation, buf: bytes) -> None:
    """The record header (and refs) at ``loc`` say what the location says."""
    where = f"object {hexid(loc.oid)} at pack {name} offset {loc.offset}"
    if len(buf) < _header_size(loc):
        raise CorruptObject(f"cannot adopt {where}: the pack ends inside its header",
                            oid=loc.oid, pack=name, offset=loc.offset)
    h = fmt.RecordHeader.unpack(buf, 0, pack=name)
    refs = tuple(buf[fmt.RECORD_HEADER.size + i * ID_SIZE:
                     fmt.RECORD_HEADER.size + (i + 1) * ID_SIZE]
                 for i in range(h.nrefs)) if h.nrefs == len(loc.refs) else None
    if (h.oid != loc.oid or h.rtype != fmt.RECORD_OBJECT or h.kind != loc.kind
            or refs != loc.refs or h.raw_len != loc.raw_len or h.length != loc.length):
        raise CorruptObject(f"cannot adopt {where}: the record's header (kind, refs, "
                            "lengths) differs from the location", oid=loc.oid, pack=name,
                            offset=loc.offset)

"""``PackSink``: a rank of a distributed put writes its objects into packs of the store
without the index (docs/FORMAT.md "Distributed commit").

Records are encoded exactly as ``PackWriter`` encodes them (same record format, same
compression rule from the store's options), so ids and bytes match a single-process put;
packs roll at the same ``pack_target_size``. Pack numbers come only from the range the
coordinator reserved (``PackStore.reserve_packs``): ranks never pick numbers themselves,
so they cannot collide with each other or with any writer, gc or repair of the store.
``seal`` writes the trailers and makes the packs durable where they live (fsync of
files and directories; a bucket's upload finished); only then may the rank report its
locations to the coordinator, which adopts them into its one commit.
No LMDB, no writer lock: a sink writes through a ``PackStorage`` (a store directory, a
shared directory, a bucket: ``engine.storage.attach``). Where other writers share the
numbers (a shared directory, a bucket) each pack's number is claimed create-only first;
a number of the range claimed elsewhere is skipped, never written twice.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Sequence

import zstandard

from ..errors import StoreClosed, StoreError
from ..format import records as fmt
from ..format.ids import object_id
from ..format.location import RecordLocation
from ..format.options import EngineOptions
from ..format.records import checked_object
from ..fs import crashpoints
from ..fs.fileio import fsync_dir, store_error
from ..packs import pack as pk
from ..packs.storage import PackStorage
from ..storage import ObjectBackend


class PacksExhausted(StoreError):
    """The sink needs a pack number beyond its reserved range: reserve more (size the
    range with ``packs_needed``)."""


# A record is its 44-byte header, 16 bytes per ref, the stored payload (never more than
# the raw one: zstd output is kept only when smaller) and an 8-byte checksum.
RECORD_OVERHEAD = fmt.RECORD_HEADER.size + fmt.CHECKSUM.size


def record_bound(payload_len: int, nrefs: int = 0) -> int:
    """The most bytes one object's record takes in a pack."""
    return RECORD_OVERHEAD + 16 * nrefs + payload_len


def packs_needed(records: int, record_bytes: int, options: EngineOptions) -> int:
    """How many pack numbers a sink may need for ``records`` objects of one kind (data,
    or meta) whose records take ``record_bytes`` in all (sum of ``record_bound``).

    A pack is rolled only when its size plus the next record exceeds the target, so of
    k packs each of the first k - 1 plus the record after it holds more than
    target - 16 (the header) bytes; every record is counted at most twice:
    k <= 2 * bytes / (target - 16) + 1, and never more than one pack per record."""
    if records <= 0:
        return 0
    room = options.pack_target_size - fmt.PACK_HEADER.size
    return min(records, 2 * record_bytes // room + 1)


class PackSink:
    """Writes records into packs numbered from ``packs`` in ``storage`` (a PackStorage,
    or a store directory: its local packs)."""

    def __init__(self, storage: str | pathlib.Path | PackStorage | ObjectBackend, packs: range,
                 options: EngineOptions) -> None:
        if not isinstance(packs, range) or packs.step != 1:
            raise TypeError(f"packs must be a range with step 1, got {packs!r}")
        if not isinstance(options, EngineOptions):
            raise TypeError(f"options must be EngineOptions, got {type(options).__name__}")
        self.storage = pk.as_storage(storage)
        self.packs = packs
        self.options = options
        self._next = packs.start
        self._open: dict[bool, pk.PackFile] = {}
        self._files: list[pk.PackFile] = []
        self._locs: dict[bytes, RecordLocation] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._done = False
        self._broken: BaseException | None = None
        self.bytes_written = 0

    def _check(self) -> None:
        if self._done:
            raise StoreClosed("sink already sealed or discarded")
        if self._broken is not None:
            raise StoreError(f"sink failed earlier and must be discarded: {self._broken}")

    def _compressor(self) -> zstandard.ZstdCompressor | None:
        level = self.options.compression_level
        if level == 0:
            return None
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(level=level)
        return cctx

    def put(self, kind: int, payload: bytes | bytearray | memoryview,
            refs: Sequence[bytes] = (), *, meta: bool = False) -> bytes:
        """Append an object; return its id. An id this sink holds writes nothing. Refs
        are not checked here (no index): the coordinator's adopt checks them."""
        self._check()
        payload, refs = checked_object(kind, payload, refs)
        oid = object_id(kind, refs, payload)
        if oid in self._locs:
            return oid
        record = fmt.encode_record_parts(fmt.RECORD_OBJECT, kind, refs, payload, oid,
                                         cctx=self._compressor())
        length = pk.record_length(record)
        with self._lock:
            self._check()
            if oid in self._locs:
                return oid
            try:
                pf = self._pack_for(length, bool(meta))
                offset = pf.append(record, fmt.RECORD_OBJECT, oid)
            except OSError as exc:
                self._broken = exc
                raise store_error("cannot append to pack", exc) from exc
            self._locs[oid] = RecordLocation(oid, kind, refs, pf.number, offset, length,
                                             len(payload), bool(meta))
            self.bytes_written += length
        return oid

    def _pack_for(self, length: int, meta: bool) -> pk.PackFile:
        """The open pack of that kind, rolled like PackSet rolls a writer's packs."""
        pf = self._open.get(meta)
        if pf is not None and pf.entries and pf.size + length > self.options.pack_target_size:
            pf.seal()
            pf.sync()
            pf.close()
            pf = None
        while pf is None:
            if self._next >= self.packs.stop:
                raise PacksExhausted(f"sink needs more than the {len(self.packs)} packs "
                                     f"reserved for it ({self.packs.start}.."
                                     f"{self.packs.stop - 1})")
            n, self._next = self._next, self._next + 1
            try:
                pf = pk.PackFile(self.storage, n, meta=meta)
            except FileExistsError:
                continue  # claimed by a writer on another cache (or a leftover): skip it
            self._files.append(pf)
            self._open[meta] = pf
        return pf

    def has(self, oid: bytes) -> bool:
        return bytes(oid) in self._locs

    @property
    def locations(self) -> list[RecordLocation]:
        return list(self._locs.values())

    def seal(self) -> list[RecordLocation]:
        """Write every trailer, fsync every pack and then their directories; return the
        locations of every object put. Only sealed, fsync'ed packs may be reported."""
        with self._lock:
            self._check()
            self._done = True
        try:
            crashpoints.hit("sink.after_pack_write")
            for pf in self._files:
                if not pf.closed:
                    pf.seal()
                    pf.sync()
            for pf in self._files:
                pf.settle()  # a bucket's uploads: every pack is there before it is named
            if not self.storage.remote:
                for d in {pf.path.parent for pf in self._files if pf.path is not None}:
                    fsync_dir(d)
        except OSError as exc:
            self._broken = exc
            raise store_error("cannot seal the sink's packs", exc) from exc
        finally:
            for pf in self._files:
                pf.close()
        crashpoints.hit("sink.after_seal")
        return list(self._locs.values())

    def discard(self) -> None:
        """Delete this sink's pack files (sealed or not); idempotent."""
        with self._lock:
            self._done = True
            files, self._files = self._files, []
            self._open.clear()
        dirs = set()
        for pf in files:
            try:
                pf.discard()
            except OSError as exc:
                raise store_error("cannot delete a sink's pack (gc reclaims it)",
                                  exc) from exc
            if not self.storage.remote and pf.path is not None:
                dirs.add(pf.path.parent)
        for d in dirs:
            try:
                fsync_dir(d)
            except OSError:
                pass

    @property
    def pack_numbers(self) -> list[int]:
        return [pf.number for pf in self._files]

    def __enter__(self) -> PackSink:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.discard()

"""``PackStoreState``: what the maintenance and write phases of a ``PackStore`` work on.

The store owns one and hands it to freshness, writer, gc, verify and repair, so none of
them reaches into the store's private fields: the seam is this typed object (path,
options, lock, index, pack readers, the id lookup and the checked record read). The read
path lives here because every phase and the store's ``get`` share it.
"""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Callable, Iterable
from typing import Protocol, cast

import xxhash
import zstandard

from ..api import Object, RepairReport
from ..errors import CorruptObject, ObjectNotFound, StoreClosed
from ..format import records as fmt
from ..format.commitdoc import CommitDoc
from ..format.ids import ID_SIZE, hexid, id_hasher
from ..format.location import RecordLocation
from ..format.options import EngineOptions
from ..fs.fileio import store_error
from ..fs.lock import WriterLock
from ..index import db as ix
from ..packs.pack import PackReaders, pack_name
from ..packs.storage import PackStorage, as_storage


class CommitLog(Protocol):
    """Where a store's commits are published, as the store's phases call it: a local
    store's index is its own log (engine/store/commit/local.py ``LocalLog``: nothing to
    publish first); a bucket or shared-directory store publishes every commit as a
    document whose cache the index is (engine/store/commit/bucket.py ``Remote``). The
    phases see this seam only, never which log it is."""

    #: True when commits are published outside the index, which then caches them.
    publishes: bool
    url: str

    def attach(self, core: PackStoreState, *, create: bool) -> RepairReport | None: ...
    def seq(self, core: PackStoreState) -> int: ...
    def catch_up(self, core: PackStoreState) -> int: ...
    def refresh(self, core: PackStoreState) -> None: ...
    def rebuild(self, core: PackStoreState) -> RepairReport: ...
    def publish(self, core: PackStoreState, base: int, doc: Callable[[], CommitDoc]) -> int | None:
        ...
    def check_age(self, started: float) -> None: ...
    def begin_gc(self, core: PackStoreState) -> None: ...
    def settle_gc(self, core: PackStoreState, seq: int | None) -> None: ...
    def delete_unlisted(self, core: PackStoreState, live_packs: set[int]) -> int: ...


_READ_RETRIES = 4


class PackStoreState:
    """One open store's state. ``index`` and ``readers`` exist once ``attach`` ran (the
    index is opened, checked and maybe rebuilt by engine/store/freshness.py)."""

    def __init__(self, path: pathlib.Path, options: EngineOptions, *, readonly: bool,
                 lock: WriterLock, storage: PackStorage | None = None,
                 log: CommitLog) -> None:
        self.path = path
        # Where the packs live; ``path`` always holds the index and the lock (local disk).
        self.storage = storage if storage is not None else as_storage(path)
        # Where commits are published: the index itself, or a bucket it caches.
        self.log = log
        self.options = options
        self.readonly = readonly
        self.lock = lock
        self.pid = os.getpid()
        self.closed = True
        self._index: ix.Index | None = None
        self._readers: PackReaders | None = None
        self._local = threading.local()

    @property
    def index(self) -> ix.Index:
        if self._index is None:
            raise StoreClosed(f"store {self.path} has no open index")
        return self._index

    @property
    def readers(self) -> PackReaders:
        if self._readers is None:
            raise StoreClosed(f"store {self.path} has no open index")
        return self._readers

    def attach(self, index: ix.Index) -> None:
        """Take ``index`` (one ``open_shared`` reference) and open the pack readers."""
        self._index = index
        self._readers = PackReaders(self.storage)
        self.closed = False

    def close_files(self) -> None:
        self.closed = True
        self.storage.close()
        if self._readers is not None:
            self._readers.close()
        if self._index is not None:
            self._index.close()

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosed(f"store {self.path} is closed")
        if os.getpid() != self.pid:
            raise StoreClosed(
                f"store {self.path} was opened in process {self.pid}; LMDB handles do not "
                "survive fork(): call engine.open() again in the child"
            )

    # -- reads ----------------------------------------------------------------------------
    def entry(self, txn: ix.Txn, oid: bytes) -> ix.ObjectEntry:
        index = self.index
        raw = txn.get(oid, db=index.objects)
        if raw is None:
            raise ObjectNotFound(f"object {hexid(oid)} not found", oid=oid)
        return index.entry(oid, raw)

    def lookup(self, oid: bytes) -> ix.ObjectEntry:
        """The index entry of ``oid`` (ObjectNotFound when it has none)."""
        return self.index.read(lambda txn: self.entry(txn, oid))

    def dctx(self) -> zstandard.ZstdDecompressor:
        """This thread's decompression context."""
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return cast(zstandard.ZstdDecompressor, dctx)

    def read_entry(self, oid: bytes, entry: ix.ObjectEntry | RecordLocation) -> Object | None:
        """Read and check one record; None when its pack vanished (gc moved it: look up
        again in a fresh transaction)."""
        return read_checked(self.readers, oid, entry.pack, entry.offset, entry.length,
                            entry.kind, self.dctx(), raw_len=entry.raw_len)

    def pack_missing(self, n: int) -> None:
        """A read found pack ``n`` gone (a gc moved its objects): drop its descriptor and,
        for a bucket store, bring the index up to date before looking the object up again."""
        self.readers.forget(n)
        self.log.refresh(self)

    def read_into(self, oid: bytes, kind: int, prefix: int, out: memoryview, *,
                  id_check: bool = True, fallback: bool = False,
                  at: RecordLocation | None = None) -> bytes | Object | None:
        """Read object ``oid`` of ``kind`` whose payload is ``prefix`` bytes followed by
        exactly ``len(out)`` bytes, straight into ``out``, when its record is stored raw:
        one preadv, no fresh buffer, no decompression. Returns the first ``prefix`` bytes
        of the payload; None (``out`` untouched) when the record is compressed, of
        another kind or size, or the pack is remote: read it with ``read`` (with
        ``fallback``, that read is done here and its Object returned: one lookup).

        What lands in ``out`` is what the writer wrote under this id: the header is
        compared with the index entry, and the payload and refs are re-hashed into the id
        (``id_check=False``: the record checksum over header, refs and payload instead, a
        writer's own hash that a deep verify re-checks; the id hash makes the checksum
        redundant, so it is not computed as well). On CorruptObject ``out`` holds
        unspecified bytes. ``at``: where ``locate`` found the record (tried first, no
        index lookup; a stale one is looked up again: the checks hold either way)."""
        entry: ix.ObjectEntry | RecordLocation | None = at
        for _ in range(_READ_RETRIES):
            if entry is None:
                entry = self.lookup(oid)
            try:
                prefix_bytes = read_raw_into(self.readers, oid, entry, kind, prefix, out,
                                             id_check=id_check)
                if prefix_bytes is not None:
                    return prefix_bytes
                if not fallback:
                    return None
                obj = self.read_entry(oid, entry)
                if obj is None:
                    raise FileNotFoundError
                return obj
            except FileNotFoundError:
                self.pack_missing(entry.pack)
                entry = None
        raise CorruptObject(f"object {hexid(oid)}: its pack keeps vanishing", oid=oid)

    def advise(self, locs: Iterable[RecordLocation]) -> None:
        """Read-ahead hint for located records (adjacent ones merge into one range)."""
        advise(self.readers, locs, lambda: self.closed)

    def check(self, oid: bytes) -> None:
        """``read``'s checks without keeping the payload (deep verify: a record that
        expands to gigabytes is hashed as it streams, never held)."""
        for _ in range(_READ_RETRIES):
            entry = self.lookup(oid)
            if read_checked(self.readers, oid, entry.pack, entry.offset, entry.length,
                            entry.kind, self.dctx(), raw_len=entry.raw_len,
                            keep=False) is not None:
                return
            self.pack_missing(entry.pack)
        self.read(oid)  # its pack keeps vanishing: read's own error

    def read(self, oid: bytes, at: RecordLocation | None = None) -> Object:
        """The checked object ``oid``, looked up again when a gc moved it meanwhile
        (``at``: where ``locate`` found it, tried first without an index lookup)."""
        entry: ix.ObjectEntry | RecordLocation | None = None
        for _ in range(_READ_RETRIES):
            entry, at = (at if at is not None else self.lookup(oid)), None
            obj = self.read_entry(oid, entry)
            if obj is not None:
                return obj
            self.pack_missing(entry.pack)
        assert entry is not None
        name = pack_name(entry.pack)
        raise CorruptObject(f"object {hexid(oid)}: pack {name} is missing", oid=oid,
                            pack=name, offset=entry.offset)


def advise(readers: PackReaders, locs: Iterable[RecordLocation],
           closed: Callable[[], bool]) -> None:
    """Ask the kernel to read the records at ``locs`` ahead (adjacent ones merge into one
    range), pack by pack until ``closed()`` (a hint may run on a thread of its own)."""
    spans: dict[int, list[list[int]]] = {}
    for loc in sorted(locs, key=lambda c: (c.pack, c.offset)):
        runs = spans.setdefault(loc.pack, [])
        if runs and loc.offset <= runs[-1][1] + (1 << 16):
            runs[-1][1] = max(runs[-1][1], loc.offset + loc.length)
        else:
            runs.append([loc.offset, loc.offset + loc.length])
    for pack, runs in spans.items():
        if closed():
            return
        readers.advise(pack, [(a, b - a) for a, b in runs])


def read_raw_into(readers: PackReaders, oid: bytes, entry: ix.ObjectEntry | RecordLocation,
                  kind: int, prefix: int, out: memoryview, *, id_check: bool) -> bytes | None:
    """The direct read of ``PackStoreState.read_into`` at ``entry`` (also a rank's, reading by
    location: engine/located.py): the record's first ``prefix`` payload bytes, the rest
    in ``out``, checked; None (``out`` untouched) when the record is not stored raw, is of
    another kind or size, or its pack is remote. FileNotFoundError when the pack is gone."""
    head_len = fmt.RECORD_HEADER.size + ID_SIZE * len(entry.refs)
    stored = entry.length - head_len - fmt.CHECKSUM.size
    head = bytearray(head_len + prefix)
    tail = bytearray(fmt.CHECKSUM.size)
    try:
        if (entry.kind != kind or entry.raw_len != prefix + len(out)
                or stored != entry.raw_len or not readers.readv(
                    entry.pack, entry.offset, [memoryview(head), out, memoryview(tail)])):
            return None
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise store_error(f"cannot read pack {pack_name(entry.pack)}", exc) from exc
    except CorruptObject as exc:
        raise CorruptObject(f"object {hexid(oid)}: {exc}", oid=oid,
                            pack=pack_name(entry.pack), offset=entry.offset) from exc
    _check_raw(oid, kind, entry, head, head_len, out, tail, id_check)
    return bytes(head[head_len:])


def _check_raw(oid: bytes, kind: int, entry: ix.ObjectEntry | RecordLocation,
               head: bytearray, head_len: int, out: memoryview, tail: bytearray,
               id_check: bool) -> None:
    """The checks ``decode_record`` makes, over a record read in three pieces."""
    name = pack_name(entry.pack)
    where = f"object {hexid(oid)} in pack {name} at offset {entry.offset}"
    try:
        h = fmt.RecordHeader.unpack(memoryview(head), 0, pack=name)
    except CorruptObject as exc:
        raise CorruptObject(f"{where} is corrupt: {exc}", oid=oid, pack=name,
                            offset=entry.offset) from exc
    problem = None
    if h.oid != oid or h.rtype != fmt.RECORD_OBJECT or h.kind != kind:
        problem = f"holds {h.oid.hex()} instead"
    elif h.codec != fmt.CODEC_RAW or h.nrefs != len(entry.refs) or h.length != entry.length:
        problem = "does not match its index entry"
    elif id_check:
        # One pass over the payload, not two: every header field was compared above (the
        # magic and version by unpack), and the id hash covers the kind, refs, length and
        # payload, so the checksum could catch nothing more. A corrupt checksum field
        # alone (the data intact) is left to a deep verify.
        refs = [bytes(head[fmt.RECORD_HEADER.size + i * ID_SIZE:][:ID_SIZE])
                for i in range(h.nrefs)]
        ih = id_hasher(kind, refs, h.raw_len)
        ih.update(memoryview(head)[head_len:])
        ih.update(out)
        if ih.digest() != oid:
            problem = "content does not hash to its id"
    else:
        s = xxhash.xxh3_64(head)
        s.update(out)
        if s.intdigest() != fmt.CHECKSUM.unpack(tail)[0]:
            problem = "checksum mismatch"
    if problem:
        raise CorruptObject(f"{where}: {problem}", oid=oid, pack=name, offset=entry.offset)


def read_checked(readers: PackReaders, oid: bytes, pack: int, offset: int, length: int,
                 kind: int, dctx: zstandard.ZstdDecompressor, *, raw_len: int | None = None,
                 keep: bool = True) -> Object | None:
    """Read the record of ``oid`` at (pack, offset, length) and check checksum, id, kind
    and that its payload is the ``raw_len`` bytes its index entry says (before anything is
    decompressed): the one checked read of the store and of ranks reading by location
    (engine/store/located.py). None when the pack file is gone (gc moved the record).
    ``keep=False`` (a deep verify): the payload is checked as it streams by and not kept;
    the Object returned then has an empty payload."""
    name = pack_name(pack)
    try:
        data = readers.read(pack, offset, length)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise store_error(f"cannot read pack {name}", exc) from exc
    except (OverflowError, ValueError) as exc:  # an offset no file can have
        raise CorruptObject(f"object {hexid(oid)}: index entry points at offset "
                            f"{offset} of pack {name}: {exc}", oid=oid, pack=name,
                            offset=offset) from exc
    except CorruptObject as exc:  # a short read: the pack was truncated
        raise CorruptObject(f"object {hexid(oid)}: {exc}", oid=oid, pack=name,
                            offset=offset) from exc
    return checked_record(data, oid, pack, offset, kind, dctx, raw_len=raw_len, keep=keep)


def checked_record(data: bytes | memoryview, oid: bytes, pack: int, offset: int, kind: int,
                   dctx: zstandard.ZstdDecompressor, *, raw_len: int | None = None,
                   keep: bool = True, as_view: bool = False) -> Object:
    """``read_checked``'s checks of ``data``, exactly the bytes of the record read at
    (pack, offset): also those of a record cut out of a longer read
    (engine/store/batchread.py), so a batched read refuses what a single one does."""
    name = pack_name(pack)
    try:
        if keep:
            rec = fmt.decode_record(data, 0, pack=name, dctx=dctx, raw_len=raw_len,
                                    as_view=as_view)
        else:
            rec = fmt.check_payload(data, 0, pack=name, dctx=dctx, raw_len=raw_len)
    except CorruptObject as exc:
        raise CorruptObject(
            f"object {hexid(oid)} in pack {name} at offset {offset} is corrupt: {exc}",
            oid=oid, pack=name, offset=offset,
        ) from exc
    h = rec.header
    if h.oid != oid or h.rtype != fmt.RECORD_OBJECT or h.kind != kind:
        raise CorruptObject(
            f"object {hexid(oid)}: pack {name} offset {offset} holds "
            f"{h.oid.hex()} instead", oid=oid, pack=name, offset=offset,
        )
    return Object(h.kind, rec.refs, rec.payload)

"""``PackStore``: the on-disk ``ObjectStore`` (packs + LMDB index), and ``open``.

Layout (docs/FORMAT.md "Directory tree")::

    <path>/lock                      writer lock (flock)
    <path>/index/                    LMDB environment (derived; ``repair`` rebuilds it)
    <path>/packs/XX/NNNNNNNN.pack    immutable pack files, XX = (N >> 8) & 0xff

Reads are thread-safe: index lookups run in short read transactions, records are read
with ``os.pread`` on cached descriptors and decompressed by per-thread zstd contexts.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import lmdb
import zstandard

from . import format as fmt
from . import index as ix
from .api import (
    GCReport,
    Object,
    ObjectInfo,
    ObjectStore,
    Problem,
    ProgressFn,
    RepairReport,
    Stats,
    VerifyReport,
    Writer,
)
from .errors import (
    CorruptObject,
    FormatError,
    ObjectNotFound,
    ReadOnly,
    StoreClosed,
    StoreError,
)
from .fileio import allocated_bytes, makedirs_durable, store_error
from .ids import check_id, hexid
from .lock import WriterLock
from .pack import pack_name, pack_path
from .writer import PackWriter, check_root_name

_READ_RETRIES = 4


def open(  # noqa: A001 - mirrors the builtin on purpose: engine.open(path)
    path: str | os.PathLike,
    *,
    create: bool = True,
    compression_level: int = 3,
    map_size: int = 1 << 30,
    pack_target_size: int = 256 << 20,
    readonly: bool = False,
) -> PackStore:
    """Open (or with ``create=True`` create) the pack store at ``path``.

    ``readonly=True`` never takes the writer lock and never writes (docs/FORMAT.md
    "Read-only access"): writer, gc and repair raise ReadOnly, and an index that is
    missing or behind its packs raises StaleIndex instead of being rebuilt."""
    return PackStore(path, create=create, compression_level=compression_level,
                     map_size=map_size, pack_target_size=pack_target_size, readonly=readonly)


def _translated(method):
    """Map OSError and lmdb errors escaping a maintenance method to StoreError, so none
    leaves the engine untranslated (the hot read path translates its own)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            raise store_error(f"{method.__name__} on {self.path} failed", exc) from exc
        except lmdb.Error as exc:
            raise StoreError(f"{method.__name__} on {self.path} failed: {exc}") from exc

    return wrapper


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, got {value!r}")


class PackStore(ObjectStore):
    def __init__(self, path: str | os.PathLike, *, create: bool = True,
                 compression_level: int = 3, map_size: int = 1 << 30,
                 pack_target_size: int = 256 << 20, readonly: bool = False) -> None:
        _check_int("compression_level", compression_level, -7, 22)
        _check_int("map_size", map_size, 1 << 16, 1 << 50)
        _check_int("pack_target_size", pack_target_size, 1 << 10, 1 << 40)
        self.path = pathlib.Path(path).absolute()
        self.compression_level = compression_level
        self.pack_target_size = pack_target_size
        self.readonly = bool(readonly)
        self.opened_with_repair: RepairReport | None = None  # set when open had to rebuild
        self._pid = os.getpid()
        self._closed = True
        # Weak, so a writer dropped without commit/abort is collected and unlocks.
        self._writer: weakref.ref[Writer] | None = None
        self._local = threading.local()
        try:
            self._prepare_dir(create and not self.readonly)
            self._lock = WriterLock(self.path / "lock")
            self._open_index(map_size, {"compression_level": compression_level,
                                        "pack_target_size": pack_target_size})
        except OSError as exc:
            raise store_error(f"cannot open store {self.path}", exc) from exc

    def _prepare_dir(self, create: bool) -> None:
        """Create the directory, or check that it is a store (before writing anything)."""
        p = self.path
        if not p.exists():
            if not create:
                raise FormatError(f"no store at {p} (pass create=True to make one)")
            makedirs_durable(p)
        elif not p.is_dir():
            raise FormatError(f"{p} is not a directory")
        entries = {e.name for e in p.iterdir()}
        if entries and not entries & {"index", "packs", "index.new"}:
            raise FormatError(f"{p} is a non-empty directory that is not a cnrstore store")
        if not entries and not create:
            raise FormatError(f"no store at {p} (pass create=True to make one)")
        if not self.readonly:
            makedirs_durable(p / "packs")

    def _open_index(self, map_size: int, options: dict) -> None:
        """Open the index, never trusting one that is missing, damaged or behind its
        packs (engine/freshness.py; docs/FORMAT.md "Index freshness")."""
        from .freshness import open_index

        open_index(self, map_size, options)

    # -- handle state ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.path} is closed")
        if os.getpid() != self._pid:
            raise StoreClosed(
                f"store {self.path} was opened in process {self._pid}; LMDB handles do not "
                "survive fork(): call engine.open() again in the child"
            )

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    # -- read side ------------------------------------------------------------------------
    def _entry(self, txn, oid: bytes) -> ix.ObjectEntry:
        raw = txn.get(oid, db=self._index.objects)
        if raw is None:
            raise ObjectNotFound(f"object {hexid(oid)} not found", oid=oid)
        return self._index.entry(oid, raw)

    def _lookup(self, oid: bytes) -> ix.ObjectEntry:
        return self._index.read(lambda txn: self._entry(txn, oid))

    def _read_entry(self, oid: bytes, entry: ix.ObjectEntry) -> Object | None:
        """Read and check one record; None when its pack vanished (gc moved it: look up
        again in a fresh transaction)."""
        name = pack_name(entry.pack)
        try:
            data = self._readers.read(entry.pack, entry.offset, entry.length)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc
        except (OverflowError, ValueError) as exc:  # an offset no file can have
            raise CorruptObject(f"object {hexid(oid)}: index entry points at offset "
                                f"{entry.offset} of pack {name}: {exc}", oid=oid, pack=name,
                                offset=entry.offset) from exc
        except CorruptObject as exc:  # a short read: the pack was truncated
            raise CorruptObject(f"object {hexid(oid)}: {exc}", oid=oid, pack=name,
                                offset=entry.offset) from exc
        try:
            rec = fmt.decode_record(data, 0, pack=name, dctx=self._dctx())
        except CorruptObject as exc:
            raise CorruptObject(
                f"object {hexid(oid)} in pack {name} at offset {entry.offset} is corrupt: {exc}",
                oid=oid, pack=name, offset=entry.offset,
            ) from exc
        h = rec.header
        if h.oid != oid or h.rtype != fmt.RECORD_OBJECT or h.kind != entry.kind:
            raise CorruptObject(
                f"object {hexid(oid)}: pack {name} offset {entry.offset} holds "
                f"{h.oid.hex()} instead", oid=oid, pack=name, offset=entry.offset,
            )
        return Object(h.kind, rec.refs, rec.payload)

    def get(self, oid: bytes) -> Object:
        self._check_open()
        check_id(oid)
        oid = bytes(oid)
        entry = None
        for _ in range(_READ_RETRIES):
            entry = self._lookup(oid)
            obj = self._read_entry(oid, entry)
            if obj is not None:
                return obj
            self._readers.forget(entry.pack)
        name = pack_name(entry.pack)
        raise CorruptObject(f"object {hexid(oid)}: pack {name} is missing", oid=oid,
                            pack=name, offset=entry.offset)

    def get_many(self, oids: Iterable[bytes]) -> Iterator[Object]:
        """Objects in the order asked; index lookups batched into one read txn per chunk."""
        self._check_open()
        chunk: list[bytes] = []
        for oid in oids:
            check_id(oid)
            chunk.append(bytes(oid))
            if len(chunk) == 256:
                yield from self._get_chunk(chunk)
                chunk = []
        if chunk:
            yield from self._get_chunk(chunk)

    def _get_chunk(self, oids: list[bytes]) -> Iterator[Object]:
        entries = self._index.read(lambda txn: [self._entry(txn, o) for o in oids])
        for oid, entry in zip(oids, entries):
            obj = self._read_entry(oid, entry)
            yield obj if obj is not None else self.get(oid)

    def info(self, oid: bytes) -> ObjectInfo:
        self._check_open()
        check_id(oid)
        e = self._lookup(bytes(oid))
        return ObjectInfo(e.kind, e.refs, e.raw_len, e.length, e.meta)

    def has(self, oid: bytes) -> bool:
        self._check_open()
        check_id(oid)
        return self._index.read(lambda t: t.get(bytes(oid), db=self._index.objects)) is not None

    def root(self, name: str) -> bytes | None:
        self._check_open()
        key = check_root_name(name)
        # Roots are where a reader enters newer state: one stat() tells whether a repair
        # elsewhere swapped in a new index directory since.
        self._index.refresh_if_replaced()
        return self._index.read(lambda t: t.get(key, db=self._index.roots))

    def roots(self) -> dict[str, bytes]:
        self._check_open()
        self._index.refresh_if_replaced()
        return self._index.read(
            lambda t: {k.decode("utf-8"): v for k, v in t.cursor(db=self._index.roots)}
        )

    # -- writes ---------------------------------------------------------------------------
    def _check_writable(self, what: str) -> None:
        if self.readonly:
            raise ReadOnly(f"{what} on store {self.path}, which was opened read-only")

    def _catch_up(self, *, full: bool) -> None:
        """With the writer lock held: rebuild an index that fell behind its packs (a
        commit on it would get a sequence below theirs and lose to them on repair; a gc
        would delete their packs as unlisted)."""
        from .freshness import stale_problem
        from .repair import rebuild

        try:
            stale = stale_problem(self, full=full) is not None
        except ix.DamagedIndex:
            stale = True  # LMDB cannot read its own pages: rebuilt from the packs
        if stale:
            rebuild(self)

    @_translated
    def writer(self, *, timeout: float | None = 0.0) -> Writer:
        self._check_open()
        self._check_writable("writer()")
        self._lock.acquire(timeout)
        try:
            replaced = self._index.refresh_if_replaced()
            self._catch_up(full=replaced)  # full check at open, and for a swapped index
            w = PackWriter(self)
        except BaseException:
            self._lock.release()
            raise
        self._writer = weakref.ref(w)
        return w

    def _writer_done(self, w: Writer) -> None:
        # A dead reference is this very writer being finalized (weakrefs clear first).
        if self._writer is not None and self._writer() in (w, None):
            self._writer = None
            self._lock.release()

    # -- maintenance (phases live in gc.py, verify.py, repair.py) -------------------------
    @_translated
    def gc(self, *, threshold: float = 0.25, timeout: float | None = 0.0,
           progress: ProgressFn | None = None) -> GCReport:
        from .gc import collect

        self._check_open()
        self._check_writable("gc()")
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a number in 0..1, got {threshold!r}")
        with self._locked(timeout):
            self._catch_up(full=True)  # gc never runs on an index behind its packs
            return collect(self, threshold=float(threshold), progress=progress)

    @_translated
    def verify(self, *, deep: bool = False, roots: Iterable[str] | None = None,
               progress: ProgressFn | None = None) -> VerifyReport:
        from .verify import verify

        self._check_open()
        try:
            return verify(self, deep=deep, roots=roots, progress=progress)
        except (CorruptObject, FormatError) as exc:
            # verify reports damage, it does not raise it: an index it cannot even walk
            # is one more problem.
            return VerifyReport(False, (Problem("unreadable-index", str(exc)),), 0, 0)

    @_translated
    def repair(self) -> RepairReport:
        from .repair import rebuild

        self._check_open()
        self._check_writable("repair()")
        with self._locked(None):
            return rebuild(self)

    @contextlib.contextmanager
    def _locked(self, timeout: float | None) -> Iterator[None]:
        self._lock.acquire(timeout)
        try:
            self._index.refresh_if_replaced()
            yield
        finally:
            self._lock.release()

    @_translated
    def stats(self) -> Stats:
        self._check_open()
        index = self._index

        def collect(txn):
            logical = sum(index.entry(k, v).raw_len
                          for k, v in txn.cursor(db=index.objects))
            packs = [ix.unpack_pack_key(k) for k, _ in txn.cursor(db=index.packs)]
            nobj = txn.stat(index.objects)["entries"]
            return nobj, logical, packs, txn.stat(index.roots)["entries"]

        nobj, logical, packs, nroots = index.read(collect)
        stored = sum(allocated_bytes(pack_path(self.path, n)) for n in packs)
        return Stats(nobj, logical, stored, len(packs), nroots)

    def close(self) -> None:
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True  # the parent owns the LMDB handle; do not touch it here
            return
        w = self._writer() if self._writer is not None else None
        if w is not None:
            w.abort()
        self._closed = True
        self._readers.close()
        self._index.close()

    def __repr__(self) -> str:
        return f"PackStore({os.fspath(self.path)!r})"

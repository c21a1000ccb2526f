"""``PackStore``: the on-disk ``ObjectStore`` (packs + LMDB index), and ``open``.

Layout (docs/FORMAT.md "Directory tree")::

    <path>/lock                      writer lock (flock)
    <path>/index/                    LMDB environment (derived; ``repair`` rebuilds it)
    <path>/packs/XX/NNNNNNNN.pack    immutable pack files, XX = (N >> 8) & 0xff

Reads are thread-safe: short read txns, pread on cached descriptors, per-thread zstd.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import lmdb

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
from ..errors import CorruptObject, FormatError, NoStore, ReadOnly, StoreError, StoreLocked
from ..format.ids import check_id, check_root_name
from ..format.location import RecordLocation
from ..format.options import EngineOptions, resolve
from ..fs.fileio import makedirs_durable, store_error
from ..fs.lock import WriterLock
from ..index import db as ix
from ..index.options import read_stored
from ..packs.storage import PackStorage
from . import coordinator
from .commit.local import LocalLog
from .core import CommitLog, PackStoreState
from .freshness import open_index, stale_problem
from .gc import collect
from .lease import Leases
from .reads import DirectReads
from .repair import rebuild
from .verify import verify
from .writer import PackWriter

F = TypeVar("F", bound=Callable[..., Any])


def open(  # noqa: A001 - mirrors the builtin on purpose: engine.open(path)
    path: str | os.PathLike,
    *,
    create: bool = True,
    compression_level: int | None = None,
    map_size: int | None = None,
    pack_target_size: int | None = None,
    readonly: bool = False,
) -> PackStore:
    """Open (or with ``create=True`` create) the pack store at ``path``.

    ``readonly=True`` never takes the writer lock and never writes (docs/FORMAT.md
    "Read-only access"): writer, gc and repair raise ReadOnly, and an index that is
    missing or behind its packs raises StaleIndex instead of being rebuilt.

    An option not given takes the value the store was created with, else the default
    (engine/format/options.py: all three are tuning, free to differ between opens)."""
    return PackStore(path, create=create, compression_level=compression_level,
                     map_size=map_size, pack_target_size=pack_target_size, readonly=readonly)


def _translated(method: F) -> F:
    """Map OSError and lmdb errors escaping a maintenance method to StoreError, so none
    leaves the engine untranslated (the hot read path translates its own)."""

    @functools.wraps(method)
    def wrapper(self: PackStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            raise store_error(f"{method.__name__} on {self.path} failed", exc) from exc
        except lmdb.Error as exc:
            raise StoreError(f"{method.__name__} on {self.path} failed: {exc}") from exc

    return wrapper  # type: ignore[return-value]


class PackStore(DirectReads, ObjectStore):
    def __init__(self, path: str | os.PathLike, *, create: bool = True,
                 compression_level: int | None = None, map_size: int | None = None,
                 pack_target_size: int | None = None, readonly: bool = False,
                 storage: PackStorage | None = None, log: CommitLog | None = None) -> None:
        """``storage``/``log`` (engine/store/opening.py): packs elsewhere and the commit
        log they publish to, ``path`` then being the local cache of the index
        (docs/FORMAT.md "Object stores"). Without them, a local store."""
        asked = {"compression_level": compression_level, "map_size": map_size,
                 "pack_target_size": pack_target_size}
        first = resolve(asked, None)  # checks what was given before anything is touched
        self.path = pathlib.Path(path).absolute()
        self.readonly = bool(readonly)
        self.opened_with_repair: RepairReport | None = None  # set when open had to rebuild
        # Weak, so a writer dropped without commit/abort is collected and unlocks.
        self._writer: weakref.ref[Writer] | None = None
        self._leases = Leases(self.path)  # pack ranges reserved by this handle
        try:
            # A bucket store's cache is ours to write even for a read-only handle.
            log = log if log is not None else LocalLog(os.fspath(self.path))
            self._cache_only = log.publishes
            self._prepare_dir(log.publishes or (create and not self.readonly))
            self._core = PackStoreState(self.path, first, lock=WriterLock(self.path / "lock"),
                                   readonly=self.readonly and not log.publishes,
                                   storage=storage, log=log)
            self.opened_with_repair = open_index(self._core)
        except OSError as exc:
            raise store_error(f"cannot open store {self.path}", exc) from exc
        try:
            report = log.attach(self._core, create=create)
        except OSError as exc:
            self.close()
            raise store_error(f"cannot open store {log.url}", exc) from exc
        except BaseException:
            self.close()
            raise
        self.opened_with_repair = report or self.opened_with_repair
        try:
            self._core.options = resolve(asked, read_stored(self._core.index))
        except BaseException:
            self.close()
            raise

    @property
    def options(self) -> EngineOptions:
        """The options this handle writes with (engine/format/options.py)."""
        return self._core.options

    @property
    def compression_level(self) -> int:
        return self._core.options.compression_level

    @property
    def pack_target_size(self) -> int:
        return self._core.options.pack_target_size

    @property
    def storage(self) -> PackStorage:
        """Where this store's packs live (ranks of a distributed put reach them too)."""
        return self._core.storage

    def _prepare_dir(self, create: bool) -> None:
        """Create the directory, or check that it is a store (before writing anything)."""
        p = self.path
        if not p.exists():
            if not create:
                raise NoStore(f"no store at {p} (pass create=True to make one)")
            makedirs_durable(p)
        elif not p.is_dir():
            raise FormatError(f"{p} is not a directory")
        entries = {e.name for e in p.iterdir()}
        if entries and not entries & {"index", "packs", "index.new"}:
            raise FormatError(f"{p} is a non-empty directory that is not a cnrstore store")
        if "commits" in entries and not self._cache_only:  # never an index beside them
            raise FormatError(f"{p} is a shared-directory store: open it with cache_dir=")
        if not entries and not create:
            raise NoStore(f"no store at {p} (pass create=True to make one)")
        if not self.readonly or self._cache_only:
            makedirs_durable(p / "packs")

    # -- handle state ---------------------------------------------------------------------
    def _check_open(self) -> None:
        self._core.check_open()

    # -- read side (get_into and prefetch: engine/store/reads.py) -------------------
    def _lookup(self, oid: bytes) -> ix.ObjectEntry:
        return self._core.lookup(oid)

    def get(self, oid: bytes) -> Object:
        self._check_open()
        check_id(oid)
        return self._core.read(bytes(oid))

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
        core = self._core
        entries = core.index.read(lambda txn: [core.entry(txn, o) for o in oids])
        for oid, entry in zip(oids, entries):
            obj = core.read_entry(oid, entry)
            yield obj if obj is not None else self.get(oid)

    def info(self, oid: bytes) -> ObjectInfo:
        self._check_open()
        check_id(oid)
        e = self._lookup(bytes(oid))
        return ObjectInfo(e.kind, e.refs, e.raw_len, e.length, e.meta)

    def has(self, oid: bytes) -> bool:
        self._check_open()
        check_id(oid)
        index = self._core.index
        return index.read(lambda t: t.get(bytes(oid), db=index.objects)) is not None

    def root(self, name: str) -> bytes | None:
        self._check_open()
        key = check_root_name(name)
        # Roots are where a reader enters newer state: one stat() tells whether a repair
        # elsewhere swapped in a new index directory since.
        index = self._core.index
        index.refresh_if_replaced()
        value = index.read(lambda t: t.get(key, db=index.roots))
        return None if value is None else bytes(value)

    def roots(self) -> dict[str, bytes]:
        self._check_open()
        index = self._core.index
        index.refresh_if_replaced()
        return index.read(lambda t: {bytes(k).decode("utf-8"): bytes(v)
                                     for k, v in t.cursor(db=index.roots)})

    # -- writes ---------------------------------------------------------------------------
    def _check_writable(self, what: str) -> None:
        if self.readonly:
            raise ReadOnly(f"{what} on store {self.path}, which was opened read-only")

    def _catch_up(self, *, full: bool) -> None:
        """With the writer lock held: rebuild an index that fell behind its packs (a
        commit on it would get a sequence below theirs and lose to them on repair; a gc
        would delete their packs as unlisted)."""
        try:
            stale = stale_problem(self._core, full=full) is not None
        except ix.DamagedIndex:
            stale = True  # LMDB cannot read its own pages: rebuilt from the packs
        if stale:
            rebuild(self._core)
        self._core.log.catch_up(self._core)  # commits other caches made meanwhile

    @_translated
    def writer(self, *, timeout: float | None = 0.0) -> Writer:
        self._check_open()
        self._check_writable("writer()")
        lock = self._core.lock
        lock.acquire(timeout)
        try:
            replaced = self._core.index.refresh_if_replaced()
            self._catch_up(full=replaced)  # full check at open, and for a swapped index
            w = PackWriter(self._core, self, self._writer_done)
        except BaseException:
            lock.release()
            raise
        self._writer = weakref.ref(w)
        return w

    def _writer_done(self, w: Writer) -> None:
        # A dead reference is this very writer being finalized (weakrefs clear first).
        if self._writer is not None and self._writer() in (w, None):
            self._writer = None
            try:  # the put that reserved them is over: unadopted rank packs are orphans
                self._leases.release_covering(getattr(w, "adopted_packs", set()))
            finally:
                self._core.lock.release()

    # -- distributed put, coordinator side (engine/store/coordinator.py, FORMAT.md) --------
    @_translated
    def reserve_packs(self, n: int, *, timeout: float | None = None) -> range:
        """Durably reserve and lease ``n`` pack numbers for ranks' ``PackSink``s: gc spares
        them until a writer given locations in the range commits or aborts, or
        ``release_packs``, close or process death ends the lease. Takes the writer lock
        briefly (waiting up to ``timeout``): call it before opening this handle's writer."""
        self._check_open()
        self._check_writable("reserve_packs()")
        if self._writer is not None and self._writer() is not None:
            raise StoreLocked(f"store {self.path}: reserve_packs while this handle has an "
                              "open writer; reserve before opening the writer")
        with self._locked(timeout):
            self._catch_up(full=False)
            return coordinator.reserve(self._core, self._leases, n)

    def release_packs(self, packs: range) -> None:
        """End the lease of a ``reserve_packs`` range (failed put: its packs become gc's)."""
        self._leases.release(packs)

    def locate(self, oids: Iterable[bytes]) -> dict[bytes, RecordLocation]:
        """Where the records of ``oids`` lie (one read txn); ids not held are absent."""
        self._check_open()
        return coordinator.locate(self._core, oids)

    def locate_closure(self, oids: Iterable[bytes]) -> dict[bytes, RecordLocation]:
        """``locate`` of ``oids`` and everything they reach by refs (one read txn)."""
        self._check_open()
        return coordinator.locate_closure(self._core, oids)

    def missing(self, oids: Iterable[bytes]) -> set[bytes]:
        """Which of ``oids`` the store does not hold (one read txn)."""
        self._check_open()
        return coordinator.missing(self._core, oids)

    # -- maintenance (phases live in gc.py, verify.py, repair.py) -------------------------
    @_translated
    def gc(self, *, threshold: float = 0.25, timeout: float | None = 0.0,
           progress: ProgressFn | None = None) -> StoreGCReport:
        self._check_open()
        self._check_writable("gc()")
        if not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a number in 0..1, got {threshold!r}")
        with self._locked(timeout):
            self._catch_up(full=True)  # gc never runs on an index behind its packs
            return collect(self._core, threshold=float(threshold), progress=progress)

    @_translated
    def verify(self, *, deep: bool = False, roots: Iterable[str] | None = None,
               progress: ProgressFn | None = None) -> StoreVerifyReport:
        self._check_open()
        try:
            return verify(self._core, deep=deep, roots=roots, progress=progress)
        except (CorruptObject, FormatError) as exc:
            # verify reports damage, it does not raise it: an index it cannot even walk
            # is one more problem.
            return StoreVerifyReport(False, (Problem("unreadable-index", str(exc)),), 0, 0)

    @_translated
    def repair(self, *, dry_run: bool = False) -> RepairReport:
        self._check_open()
        if dry_run and self.readonly:  # only reads: a read-only handle may plan
            return rebuild(self._core, dry_run=True)
        self._check_writable("repair()")
        with self._locked(None):
            return rebuild(self._core, dry_run=dry_run)

    @contextlib.contextmanager
    def _locked(self, timeout: float | None) -> Iterator[None]:
        self._core.lock.acquire(timeout)
        try:
            self._core.index.refresh_if_replaced()
            yield
        finally:
            self._core.lock.release()

    @_translated
    def stats(self) -> Stats:
        self._check_open()
        index = self._core.index

        def collect(txn: Any) -> tuple[int, int, list[int], int]:
            logical = sum(index.entry(k, v).raw_len
                          for k, v in txn.cursor(db=index.objects))
            packs = [ix.unpack_pack_key(k) for k, _ in txn.cursor(db=index.packs)]
            nobj = txn.stat(index.objects)["entries"]
            return nobj, logical, packs, txn.stat(index.roots)["entries"]

        nobj, logical, packs, nroots = index.read(collect)
        sizes = self._core.storage.sizes()
        stored = sum(sizes.get(n, 0) for n in packs)
        return Stats(nobj, logical, stored, len(packs), nroots)

    def close(self) -> None:
        core = getattr(self, "_core", None)
        if core is None or core.closed:
            return
        if os.getpid() != core.pid:
            core.closed = True  # the parent owns the LMDB handle; do not touch it here
            return
        w = self._writer() if self._writer is not None else None
        if w is not None:
            w.abort()
        self._leases.close()
        core.close_files()

    def __repr__(self) -> str:
        if self._core.log.publishes:
            return f"PackStore({self._core.storage.describe()!r}, cache={os.fspath(self.path)!r})"
        return f"PackStore({os.fspath(self.path)!r})"

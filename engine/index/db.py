"""The LMDB index: key/value schema (docs/FORMAT.md "Index") and safe transactions.

All lmdb errors are translated to StoreError subclasses here. Map growth (MapFullError)
happens only in write transactions, which run under the writer lock; readers of another
process that see the grown map get MapResizedError and adopt the new size.
"""

from __future__ import annotations

import os
import pathlib
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import lmdb
import msgpack

from ..errors import FormatError, StoreError
from ..format import records as fmt
from .entries import (  # noqa: F401 - the index's value layouts, re-exported
    ObjectEntry,
    PackEntry,
    pack_key,
    unpack_pack_key,
)
from .lmdbcheck import (  # noqa: F401
    CORRUPTION,
    DamagedIndex,
    UnknownIndexVersion,
    UnsafeIndexFile,
    data_file_problem,
)
from .meta import (  # noqa: F401 - meta helpers, re-exported for index users
    I64,
    META_CHAIN,
    META_META_SUM,
    META_NEXT_PACK,
    META_OPTIONS,
    META_ROOTS_SUM,
    META_SEQ,
    META_SNAPSHOT_PACK,
    META_VERSION,
    U64,
    Txn,
    chain_value,
    get_chain,
    get_next_pack,
    get_snapshot_pack,
    get_u64,
    meta_problem,
    put_meta_checksum,
    roots_digest,
    roots_problem,
    updated_digest,
)

T = TypeVar("T")

DB_OBJECTS = b"objects"
DB_ROOTS = b"roots"
DB_PACKS = b"packs"
DB_META = b"meta"

_REFRESH_S = 1.0  # how often readers look for an index directory swapped by repair

META_ENTRY_SUMS = b"entry_checksums"  # u64 1: every object entry carries its checksum


# LMDB forbids opening one environment twice in a process (closing either would drop the
# other's locks), so handles of one store in one process share one Index.
_SHARED: dict[tuple[int, str], Index] = {}
_SHARED_LOCK = threading.RLock()


def _after_fork_in_child() -> None:
    global _SHARED_LOCK
    _SHARED_LOCK = threading.RLock()  # another thread may have held it at fork time


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_shared(path: pathlib.Path, *, map_size: int, options: dict,
                readonly: bool = False) -> Index:
    """The process-wide Index of ``path``; each call must be paired with ``close()``.
    A read-only handle shares a writable environment already open; a writable one
    cannot share a read-only one (close the read-only handles first)."""
    key = (os.getpid(), os.path.realpath(path))
    with _SHARED_LOCK:
        for stale in [k for k in _SHARED if k[1] == key[1] and k[0] != key[0]]:
            # Inherited over fork(): release the parent's environment in this process
            # only (LMDB locks are per process, its reader slots carry the parent's pid),
            # so that this child may open the store afresh.
            _SHARED.pop(stale)._close_inherited()
        index = _SHARED.get(key)
        if index is not None and index.readonly and not readonly:
            raise StoreError(f"index {path} is open read-only in this process; close "
                             "those handles before opening the store writable")
        if index is None:
            index = Index(path, map_size=map_size, create=True, options=options,
                          readonly=readonly)
            index._shared_key = key
            _SHARED[key] = index
        index._users += 1
        return index


class Index:
    """An open LMDB environment with the four named databases."""

    def __init__(self, path: pathlib.Path, *, map_size: int, create: bool,
                 options: dict | None = None, readonly: bool = False) -> None:
        self.path = path
        self._shared_key: tuple[int, str] | None = None
        self._users = 0
        self.readonly = readonly
        self._open_env(map_size, create)
        # A grow (set_mapsize) needs no transaction of this process to be active.
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False
        try:
            self._init_meta(options or {})
        except BaseException:
            self.env.close()  # the caller may rebuild this very directory next
            raise

    def trees_problem(self) -> str | None:
        """Why the index file's trees cannot be trusted, walking ``objects`` too: what a
        verify, gc or repair (each reads all of ``objects``) checks first, since a
        flipped page pointer there makes LMDB read past the file (SIGBUS)."""
        return data_file_problem(self.path / "data.mdb", all_trees=True)

    def _open_env(self, map_size: int, create: bool) -> None:
        data = self.path / "data.mdb"
        problem = data_file_problem(data)
        if problem is not None:
            # The one walk of an open: freshness.py opens first and asks afterwards.
            raise UnsafeIndexFile(f"index {self.path} cannot be trusted: {problem}",
                                  problem=problem)
        if data.exists():
            map_size = max(map_size, data.stat().st_size)
        try:
            self.env = self._lmdb_open(map_size, create)
            if not self.readonly:
                self.env.reader_check()  # clear slots of dead reader processes
            self.objects = self.env.open_db(DB_OBJECTS)
            self.roots = self.env.open_db(DB_ROOTS)
            self.packs = self.env.open_db(DB_PACKS)
            self.meta = self.env.open_db(DB_META)
            self._identity = self._file_identity()
        except CORRUPTION as exc:
            raise DamagedIndex(f"cannot open index {self.path}: {exc}") from exc
        except lmdb.Error as exc:
            raise StoreError(f"cannot open index {self.path}: {exc}") from exc
        self._checked = time.monotonic()

    def _lmdb_open(self, map_size: int, create: bool) -> lmdb.Environment:
        kw: dict[str, Any] = dict(map_size=map_size, subdir=True, max_dbs=4,
                                  readahead=False, meminit=False, max_spare_txns=0)
        if not self.readonly:
            return lmdb.open(os.fspath(self.path), create=create, **kw)
        try:
            # Registered as a reader in lock.mdb, so a concurrent writer cannot recycle
            # the pages this handle reads (FORMAT.md "Read-only access").
            return lmdb.open(os.fspath(self.path), create=False, readonly=True, **kw)
        except lmdb.Error:
            # lock.mdb not writable (read-only filesystem or permissions): no reader
            # table; reads stay checksummed and looked up again when a pack moves.
            return lmdb.open(os.fspath(self.path), create=False, readonly=True, lock=False,
                             **kw)

    def _file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path / "data.mdb")
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def refresh_if_replaced(self) -> bool:
        """Reopen when another process swapped in a rebuilt index directory (repair's
        fallback): a stale environment would lose commits and miss new ones."""
        self._checked = time.monotonic()
        now = self._file_identity()
        if now is None or now == self._identity:
            return False

        def reopen() -> None:
            size = self.env.info()["map_size"]
            self.env.close()
            self._open_env(size, False)

        self._exclusive(reopen)
        return True

    def replace_files(self, swap: Callable[[], None]) -> None:
        """Close the environment, let ``swap`` replace its directory, and reopen it; every
        handle sharing this Index sees the new files (used by repair)."""

        def action() -> None:
            size = self.env.info()["map_size"]
            self.env.close()
            try:
                swap()
            finally:
                self._open_env(size, False)

        self._exclusive(action)

    def _init_meta(self, options: dict) -> None:
        def init(txn: Txn) -> int:
            raw = txn.get(META_VERSION, db=self.meta)
            if raw is None:
                txn.put(META_VERSION, U64.pack(fmt.FORMAT_VERSION), db=self.meta)
                txn.put(META_NEXT_PACK, U64.pack(0), db=self.meta)
                txn.put(META_SEQ, U64.pack(0), db=self.meta)
                txn.put(META_SNAPSHOT_PACK, I64.pack(-1), db=self.meta)
                txn.put(META_OPTIONS, msgpack.packb(options), db=self.meta)
                txn.put(META_ENTRY_SUMS, U64.pack(1), db=self.meta)
                txn.put(META_ROOTS_SUM, roots_digest({}), db=self.meta)
                put_meta_checksum(txn, self.meta)
                return fmt.FORMAT_VERSION
            return U64.unpack(raw)[0] if len(raw) == U64.size else -1

        has_version, problem = self.read(lambda t: (t.get(META_VERSION, db=self.meta),
                                                    meta_problem(t, self.meta)))
        if has_version is None and self.readonly:
            version = fmt.FORMAT_VERSION  # an empty index: nothing to read, nothing to init
        elif has_version is None:
            version = self.write(init)
        else:
            version = U64.unpack(has_version)[0] if len(has_version) == U64.size else -1
        if version != fmt.FORMAT_VERSION:
            # A newer cnrstore's index, or a damaged one: only the packs can tell
            # (freshness.open_index), the index's own checksum could be a newer scheme.
            self.close()
            raise UnknownIndexVersion(
                f"index {self.path} has format version {version}; this cnrstore reads "
                f"version {fmt.FORMAT_VERSION} only", version=version)
        if problem is not None:
            self.close()
            raise DamagedIndex(f"index {self.path}: {problem}")
        self.legacy_entries = self.read(
            lambda t: t.get(META_ENTRY_SUMS, db=self.meta)) != U64.pack(1)

    def entry(self, oid: bytes, raw: bytes) -> ObjectEntry:
        """Decode the entry of ``oid`` as this index's version demands."""
        return ObjectEntry.decode(raw, oid, legacy_ok=self.legacy_entries)

    def upgrade_entries(self) -> int:
        """Give every checksum-less entry its checksum (with the writer lock held), then
        demand checksums from here on. Returns how many entries were rewritten."""
        if not self.legacy_entries:
            return 0

        def upgrade(txn: Txn) -> int:
            done = 0
            for key, raw in list(txn.cursor(db=self.objects)):
                entry = ObjectEntry.decode(raw, key, legacy_ok=True)
                txn.put(key, entry.encode(key), db=self.objects)
                done += 1
            txn.put(META_ENTRY_SUMS, U64.pack(1), db=self.meta)
            if txn.get(META_ROOTS_SUM, db=self.meta) is None:
                roots = {bytes(k): bytes(v) for k, v in txn.cursor(db=self.roots)}
                txn.put(META_ROOTS_SUM, roots_digest(roots), db=self.meta)
            return done

        done = self.write(upgrade)
        self.legacy_entries = False
        return done

    def _begin_read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        with self.env.begin(buffers=False) as txn:
            return fn(txn)

    def _enter(self) -> None:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1

    def _leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a short read transaction (thread-safe)."""
        if time.monotonic() - self._checked > _REFRESH_S:
            self.refresh_if_replaced()
        for _ in range(8):
            self._enter()
            try:
                return self._begin_read(fn)
            except lmdb.MapResizedError:
                pass  # another process grew the map: adopt its size below, then retry
            except CORRUPTION as exc:
                raise DamagedIndex(f"index {self.path} read failed: {exc}") from exc
            except lmdb.Error as exc:
                raise StoreError(f"index read failed: {exc}") from exc
            except _DAMAGE as exc:
                raise _damaged(self.path, exc) from exc
            finally:
                self._leave()
            self._exclusive(lambda: self.env.set_mapsize(0))
        raise StoreError("index read failed: the map size keeps changing")

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction, doubling the map on MapFullError.

        ``fn`` may run more than once, so it must only touch the transaction. Write
        transactions count as active too: a map resize must wait for them."""
        while True:
            self._enter()
            try:
                with self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                grow = True
            except lmdb.MapResizedError:
                grow = False  # another process grew it first: adopt that size
            except CORRUPTION as exc:
                raise DamagedIndex(f"index {self.path} write failed: {exc}") from exc
            except lmdb.Error as exc:
                raise StoreError(f"index write failed: {exc}") from exc
            except _DAMAGE as exc:
                raise _damaged(self.path, exc) from exc
            finally:
                self._leave()
            if grow:
                self._grow()
            else:
                self._exclusive(lambda: self.env.set_mapsize(0))

    def _exclusive(self, action: Callable[[], None]) -> None:
        with self._cond:
            self._resizing = True
            while self._active:
                self._cond.wait()
            try:
                action()
            finally:
                self._resizing = False
                self._cond.notify_all()

    def _grow(self) -> None:
        size = self.env.info()["map_size"]
        self._exclusive(lambda: self.env.set_mapsize(size * 2))

    @property
    def map_size(self) -> int:
        return self.env.info()["map_size"]

    def sync(self) -> None:
        self.env.sync(True)

    def _close_inherited(self) -> None:
        try:
            self.env.close()
        except lmdb.Error:
            pass

    def close(self) -> None:
        """Drop one user; the environment closes with its last user."""
        with _SHARED_LOCK:
            if self._shared_key is not None:
                self._users -= 1
                if self._users > 0:
                    return
                _SHARED.pop(self._shared_key, None)
            self.env.close()


# What Python raises on bytes that are not what the index schema says (a root name that is
# not utf-8, a value of the wrong length, a number too large to use): the store's own
# FormatError at this boundary, never the builtin.
_DAMAGE = (ValueError, OverflowError, struct.error, TypeError)


def _damaged(path: object, exc: BaseException) -> FormatError:
    return DamagedIndex(f"index {path} is damaged ({type(exc).__name__}: {exc}); repair "
                       "rebuilds it from the packs")

"""A dict-backed twin of the pack store: the fast fixture and the test oracle.

Same contract as ``engine.store.PackStore`` (see ``engine.api``), without files: objects
and roots live in dicts, a writer buffers its changes and applies them at commit, gc is
mark & sweep over the same refs. One writer at a time per instance.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Sequence

from ..api import (
    CommitInfo,
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
from ..errors import CorruptObject, ObjectNotFound, RootExists, StoreClosed, StoreLocked
from ..format.ids import check_id, check_root_name, hexid, object_id
from ..format.records import checked_object
from .walk import Via, walk


class MemoryStore(ObjectStore):
    def __init__(self) -> None:
        self._objects: dict[bytes, tuple[Object, bool]] = {}
        self._roots: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._closed = False
        # Weak, like the pack store's: a writer dropped without commit/abort unlocks.
        self._writer: weakref.ref[_MemoryWriter] | None = None

    # -- read side -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("memory store is closed")

    def get(self, oid: bytes) -> Object:
        self._check_open()
        check_id(oid)
        try:
            obj = self._objects[bytes(oid)][0]
        except KeyError:
            raise ObjectNotFound(f"object {hexid(oid)} not found", oid=oid) from None
        if object_id(obj.kind, obj.refs, obj.payload) != oid:
            raise CorruptObject(f"object {hexid(oid)} does not match its id", oid=oid)
        return obj

    def info(self, oid: bytes) -> ObjectInfo:
        obj = self.get(oid)
        meta = self._objects[bytes(oid)][1]
        n = len(obj.payload)
        return ObjectInfo(obj.kind, obj.refs, n, n, meta)

    def has(self, oid: bytes) -> bool:
        self._check_open()
        return bytes(oid) in self._objects

    def root(self, name: str) -> bytes | None:
        self._check_open()
        check_root_name(name)
        return self._roots.get(name)

    def roots(self) -> dict[str, bytes]:
        self._check_open()
        return dict(self._roots)

    # -- writes ----------------------------------------------------------------------
    def writer(self, *, timeout: float | None = 0.0) -> Writer:
        self._check_open()
        acquired = self._lock.acquire(timeout=-1 if timeout is None else timeout)
        if not acquired:
            raise StoreLocked("memory store already has a writer")
        w = _MemoryWriter(self)
        self._writer = weakref.ref(w)
        return w

    # -- maintenance -----------------------------------------------------------------
    def _reachable(self, names: Iterable[str] | None = None) -> tuple[set[bytes], list[Problem]]:
        problems: list[Problem] = []
        wanted = self._roots if names is None else {n: self._roots.get(n) for n in names}
        starts = []
        for name, oid in wanted.items():
            if oid is None:
                problems.append(Problem("missing-root", f"root {name!r} does not exist"))
            else:
                starts.append((oid, name))

        def refs_of(oid: bytes, via: Via) -> tuple[bytes, ...] | None:
            entry = self._objects.get(oid)
            if entry is None:
                problems.append(Problem("missing", f"object {hexid(oid)} missing", oid=oid))
                return None
            return entry[0].refs

        return walk(starts, refs_of), problems

    def gc(
        self,
        *,
        threshold: float = 0.25,
        timeout: float | None = 0.0,
        progress: ProgressFn | None = None,
    ) -> StoreGCReport:
        w = self.writer(timeout=timeout)
        try:
            live, _ = self._reachable()
            dead = [oid for oid in self._objects if oid not in live]
            freed = sum(len(self._objects[oid][0].payload) for oid in dead)
            for oid in dead:
                del self._objects[oid]
        finally:
            w.abort()
        return StoreGCReport(len(live & self._objects.keys()), len(dead), freed, 0, 0)

    def verify(
        self,
        *,
        deep: bool = False,
        roots: Iterable[str] | None = None,
        progress: ProgressFn | None = None,
    ) -> StoreVerifyReport:
        self._check_open()
        live, problems = self._reachable(roots)
        nbytes = 0
        if deep:
            for oid in live:
                entry = self._objects.get(oid)
                if entry is None:
                    continue
                obj = entry[0]
                nbytes += len(obj.payload)
                if object_id(obj.kind, obj.refs, obj.payload) != oid:
                    problems.append(Problem("corrupt", f"object {hexid(oid)} corrupt", oid=oid))
        return StoreVerifyReport(not problems, tuple(problems), len(live), nbytes)

    def repair(self, *, dry_run: bool = False) -> RepairReport:
        self._check_open()
        return RepairReport(0, len(self._objects), len(self._roots), dry_run=dry_run)

    def stats(self) -> Stats:
        self._check_open()
        logical = sum(len(o.payload) for o, _ in self._objects.values())
        return Stats(len(self._objects), logical, 0, 0, len(self._roots))

    def close(self) -> None:
        self._closed = True


class _MemoryWriter(Writer):
    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._new: dict[bytes, tuple[Object, bool]] = {}
        self._roots: dict[str, bytes | None] = {}
        self._creates: set[str] = set()
        self._pid = os.getpid()
        self._reused = 0
        self._payload_new = 0
        self._done = False

    def _check(self) -> None:
        if self._done:
            raise StoreClosed("writer already committed or aborted")

    def has(self, oid: bytes) -> bool:
        return bytes(oid) in self._new or self._store.has(oid)

    def put(
        self,
        kind: int,
        payload: bytes | bytearray | memoryview,
        refs: Sequence[bytes] = (),
        *,
        meta: bool = False,
    ) -> bytes:
        self._check()
        payload, refs = checked_object(kind, payload, refs)  # the pack store's own checks
        oid = object_id(kind, refs, payload)
        for ref in refs:
            if not self.has(ref):
                raise ObjectNotFound(f"ref {hexid(ref)} does not exist", oid=ref)
        if self.has(oid):
            self._reused += 1
        else:
            self._new[oid] = (Object(kind, refs, payload), meta)
            self._payload_new += len(payload)
        return oid

    @property
    def payload_bytes_new(self) -> int:
        return self._payload_new

    def set_root(self, name: str, oid: bytes) -> None:
        self._check()
        check_root_name(name)
        check_id(oid)
        if not self.has(oid):
            raise ObjectNotFound(f"root target {hexid(oid)} does not exist", oid=oid)
        self._roots[name] = bytes(oid)

    def create_root(self, name: str, oid: bytes) -> None:
        self._check()
        check_root_name(name)
        pending = name in self._roots  # deleted earlier in this writer: a plain move
        current = self._roots[name] if pending else self._store._roots.get(name)
        if current is not None:
            raise RootExists(f"root {name!r} already exists", name=name)
        self.set_root(name, oid)
        if not pending:
            self._creates.add(name)

    def delete_root(self, name: str) -> None:
        self._check()
        check_root_name(name)
        current = self._roots[name] if name in self._roots else self._store._roots.get(name)
        if current is None:
            raise ObjectNotFound(f"root {name!r} does not exist", name=name)
        self._roots[name] = None
        self._creates.discard(name)

    def commit(self) -> CommitInfo:
        self._check()
        self._done = True
        try:
            for name in sorted(self._creates):
                if name in self._store._roots:
                    raise RootExists(f"root {name!r} already exists; nothing of this "
                                     "transaction was published", name=name)
            self._store._objects.update(self._new)
            for name, oid in self._roots.items():
                if oid is None:
                    self._store._roots.pop(name, None)
                else:
                    self._store._roots[name] = oid
            nbytes = sum(len(o.payload) for o, _ in self._new.values())
            return CommitInfo(nbytes, len(self._new), self._reused)
        finally:
            self._store._lock.release()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._store._lock.release()

    def __del__(self) -> None:
        # A writer dropped without commit or abort must not keep the store locked.
        try:
            if not self._done and os.getpid() == self._pid:
                self.abort()
        except Exception:
            pass

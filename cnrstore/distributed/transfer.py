"""How objects travel between ranks and the coordinator's store (docs/FORMAT.md,
"Distributed commit").

A rank never opens the LMDB index: it writes the objects of its blocks into packs whose
numbers the coordinator reserved (``engine.PackSink``, through the store's pack storage:
the store directory, a shared directory, or a bucket) and reports their locations; the
coordinator adopts them into its one commit (``Writer.adopt``). For a read, the
coordinator sends the locations of the records a rank needs (``locate_closure``) and the
rank reads them through the same storage (``engine.LocatedObjects``), so
core/restore.py runs unchanged on it. Ranks reach the storage from the coordinator's
locator (``attach``): a bucket client is built on each rank, never pickled. A store that
is not a pack store (no ``reserve_packs``) gets the bytes themselves through the process
group instead: same protocol, only slower.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import engine
from engine import EngineOptions, Object, ObjectStore, RecordLocation, object_id

__all__ = ["Uploader", "grants", "release", "adopt", "missing", "locate", "Readers",
           "storage_of", "locator", "attach", "detach", "moved", "moved_everywhere", "again"]


def storage_of(objects: ObjectStore) -> Any:
    """The coordinator's pack storage (None for a store that is not a pack store)."""
    return objects.storage if isinstance(objects, engine.PackStore) else None


def locator(storage: Any) -> Any:
    return None if storage is None else storage.locator()


def attach(where: Any, storage_options: Mapping[str, Any] | None
           ) -> tuple[Any, str | None]:
    """On a rank other than the coordinator: the storage ``where`` names, and the
    temporary directory of its own where packs bound for a bucket are staged."""
    if where is None:
        return None, None
    staging = tempfile.mkdtemp(prefix="cnrstore-rank-") if where[0] == "s3" else None
    try:
        from engine.storage import attach as attach_storage

        return attach_storage(tuple(where), staging=staging or "",
                              storage_options=storage_options), staging
    except BaseException:
        detach(None, staging)
        raise


def detach(storage: Any, staging: str | None) -> None:
    """Undo ``attach`` (uploads finished, staging directory removed)."""
    try:
        if storage is not None:
            storage.close()
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _located(objects: ObjectStore) -> bool:
    return isinstance(objects, engine.PackStore)


def missing(objects: ObjectStore, oids: list[bytes]) -> set[bytes]:
    """Those of ``oids`` the coordinator's store lacks."""
    if isinstance(objects, engine.PackStore):
        return set(objects.missing(oids))
    return {o for o in oids if not objects.has(o)}


def grants(objects: ObjectStore, nbytes: list[int]) -> list[Any]:
    """Per rank, what its Uploader may write into: reserved (leased) pack numbers, enough
    for ``nbytes`` of records, or inline. Call before the coordinator's writer opens."""
    if not isinstance(objects, engine.PackStore):
        return [("inline",) for _ in nbytes]
    target = objects.pack_target_size
    wire = objects.options.to_wire()
    out: list[Any] = []
    for n in nbytes:
        # Records may be a little larger than payloads (incompressible data): one spare,
        # and one more a writer on another cache may have claimed meanwhile.
        k = n // target + 2 if n else 0
        out.append(("packs", None, objects.reserve_packs(k) if k else range(0), wire))
    return out


def release(objects: ObjectStore, given: list[Any]) -> None:
    """End the leases of ``grants`` whose put failed (their packs become gc's orphans)."""
    if isinstance(objects, engine.PackStore):
        for g in given:
            if g[0] == "packs" and len(g[2]):
                objects.release_packs(g[2])


class Uploader:
    """A rank's side of one put: ``put`` the objects assigned to it, ``seal`` returns what
    the coordinator adopts (locations, or the objects inline)."""

    def __init__(self, grant: Any, storage: Any):
        self._inline: list[tuple[int, tuple[bytes, ...], bytes]] = []
        self._sink: engine.PackSink | None = None
        if grant[0] == "packs" and len(grant[2]):
            _, _, packs, wire = grant
            self._sink = engine.PackSink(storage, packs, EngineOptions.from_wire(wire))

    def put(self, kind: int, payload: bytes, refs: tuple[bytes, ...]) -> None:
        if self._sink is not None:
            self._sink.put(kind, payload, refs)
        else:
            self._inline.append((kind, tuple(refs), bytes(payload)))

    def seal(self) -> Any:
        if self._sink is not None:
            return ("locs", [loc.to_wire() for loc in self._sink.seal()])
        return ("inline", self._inline)

    def discard(self) -> None:
        if self._sink is not None:
            self._sink.discard()


def adopt(w: Any, sealed: list[Any]) -> None:
    """Add every rank's sealed objects to the coordinator's transaction ``w`` (the writer
    counts them in its commit's bytes and objects)."""
    locs: list[RecordLocation] = []
    for kind, data in sealed:
        if kind == "locs":
            locs.extend(RecordLocation.from_wire(wire) for wire in data)
        else:
            for k, refs, p in data:
                w.put(k, p, refs)
    if locs:
        w.adopt(locs)


def locate(objects: ObjectStore, oids: list[bytes]) -> Any:
    """What a rank needs to read ``oids`` and the patch chains under them."""
    if isinstance(objects, engine.PackStore):
        return ("locs", None,
                [loc.to_wire() for loc in objects.locate_closure(oids).values()])
    seen: dict[bytes, tuple] = {}
    todo = list(oids)
    while todo:
        oid = todo.pop()
        if oid in seen:
            continue
        obj = objects.get(oid)
        seen[oid] = (obj.kind, obj.refs, obj.payload)
        todo.extend(obj.refs)
    return ("inline", seen)


class _Inline:
    """The objects of an inline answer, read like a store (``get``; ids re-checked)."""

    def __init__(self, objs: dict[bytes, tuple]):
        self._objs = objs

    def get(self, oid: bytes) -> Object:
        from cnrstore.errors import CorruptData, MissingObject

        if oid not in self._objs:
            raise MissingObject(f"object {oid.hex()} was not sent to this rank", oid=oid)
        kind, refs, payload = self._objs[oid]
        if object_id(kind, refs, payload) != oid:
            raise CorruptData(f"object {oid.hex()} arrived damaged", oid=oid)
        return Object(kind, tuple(refs), payload)

    def info(self, oid: bytes) -> engine.ObjectInfo:
        """What the sizes of a block chain are checked by before it is decoded
        (blocks.plan_chain), from the objects as sent."""
        from cnrstore.errors import MissingObject

        if oid not in self._objs:
            raise MissingObject(f"object {oid.hex()} was not sent to this rank", oid=oid)
        kind, refs, payload = self._objs[oid]
        return engine.ObjectInfo(kind, tuple(refs), len(payload), len(payload), False)


class Readers:
    """One ``LocatedReader`` over the store's pack storage, kept open across reads."""

    def __init__(self, storage: Any) -> None:
        self._storage = storage
        self._reader: engine.LocatedReader | None = None

    def source(self, answer: Any) -> Any:
        """An object source (``get``) for a rank from ``locate``'s answer."""
        if answer[0] == "locs":
            if self._reader is None:
                self._reader = engine.LocatedReader(self._storage)
            locs = [RecordLocation.from_wire(w) for w in answer[2]]
            return engine.LocatedObjects(self._reader, {loc.oid: loc for loc in locs})
        return _Inline(answer[1])

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


class _Moved(Exception):
    """Raised on every rank when a read failed only because a rank met a pack that is
    gone (a gc on another cache moved its records after the coordinator located them)."""


def moved_everywhere(what: str) -> None:
    """Raised on every rank alike (the closing round of a read agreed on it)."""
    raise _Moved(what)


def moved(err: BaseException | None) -> bool:
    """Whether ``err`` is, or was caused by, the engine's PackMoved."""
    while err is not None:
        if isinstance(err, engine.PackMoved):
            return True
        err = err.__cause__ or err.__context__
    return False


def again(ds: Any, read: Any) -> Any:
    """Run the collective ``read``; if a rank met a moved pack, the coordinator brings its
    index up to date (a writer opened and aborted catches up with the commits other
    caches made) and every rank reads once more, with fresh locations. A second miss
    raises the error itself."""
    ds.retry_moved = True
    try:
        return read()
    except _Moved:
        pass
    finally:
        ds.retry_moved = False
    if ds.is_coordinator and isinstance(ds.local.objects, engine.PackStore):
        try:
            ds.local.objects.writer(timeout=ds.options.lock_timeout).abort()
        except engine.StoreError:
            pass  # the read then fails with the engine's own error
    return read()

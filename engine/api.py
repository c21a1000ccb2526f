"""The object-store contract shared by the LMDB+pack store and its in-memory twin.

An object is (kind, refs, payload); its id is ``engine.ids.object_id``. A store holds
objects and named roots (name -> id). All changes go through a ``Writer`` (one at a time
per store, across processes), which commits its puts and root moves atomically.
Reports are frozen dataclasses so tests can compare them.

Distributed put (docs/FORMAT.md "Distributed commit"): the coordinator's store reserves
pack numbers (``reserve_packs``), answers ``missing`` / ``locate`` / ``locate_closure``,
and its writer ``adopt``s the records ranks wrote with ``engine.PackSink``; ranks read by
location with ``engine.LocatedReader`` / ``LocatedObjects``. The in-memory twin has no
packs: there ``reserve_packs``, ``locate``, ``locate_closure`` and ``Writer.adopt`` raise
``NotSupported`` (``missing`` works on every store).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import NotSupported

if TYPE_CHECKING:
    from .format.location import RecordLocation

ProgressFn = Callable[[int, int], None]  # (done, total); total may be 0 when unknown


@dataclass(frozen=True)
class Object:
    kind: int
    refs: tuple[bytes, ...]
    payload: bytes


@dataclass(frozen=True)
class ObjectInfo:
    """What the index knows of an object without reading its payload."""

    kind: int
    refs: tuple[bytes, ...]
    raw_len: int      # uncompressed payload length
    stored_len: int   # bytes the record takes on disk (header, refs, payload, checksum)
    meta: bool        # stored in a metadata pack


@dataclass(frozen=True)
class CommitInfo:
    bytes_written: int    # record bytes appended to packs by this commit
    objects_new: int
    objects_reused: int   # puts of ids that already existed (dedup: nothing written)


@dataclass(frozen=True)
class Problem:
    what: str             # "missing", "corrupt", "missing-pack", "dangling-root", ...
    message: str
    oid: bytes | None = None
    pack: str | None = None
    offset: int | None = None


@dataclass(frozen=True)
class StoreVerifyReport:
    ok: bool
    problems: tuple[Problem, ...]
    objects_checked: int
    bytes_checked: int


@dataclass(frozen=True)
class StoreGCReport:
    objects_live: int
    objects_freed: int
    bytes_freed: int          # bytes released on disk (allocated blocks), after compaction
    packs_rewritten: int
    packs_deleted: int
    # Packs gc could not read (left in place, nothing of them deleted): repair's business.
    unreadable: tuple[Problem, ...] = ()


@dataclass(frozen=True)
class RootRepair:
    """What repair does with one root whose DAG is not intact (docs/FORMAT.md "Recovery
    and repair"): ``action`` is "damaged" (kept at ``oid``: everything it reaches but
    ``lost`` still reads), "rolled-back" (pointed at ``target``, an older one) or
    "dropped"."""

    name: str
    oid: bytes                     # the target the packs' newest roots records name
    action: str
    target: bytes | None           # what the rebuilt index points the name at
    reason: str
    lost: tuple[bytes, ...] = ()   # objects it reaches that no pack holds intact
    # (ref of the root's object, the lost objects reached through it), in ref order
    branches: tuple[tuple[bytes, tuple[bytes, ...]], ...] = ()
    # The root's object as the scan read it ("damaged" only): lets the layer above name
    # its refs (cnrstore's table names).
    node: Object | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class RepairReport:
    packs_scanned: int
    objects_indexed: int
    roots_restored: int
    damaged: tuple[Problem, ...] = field(default_factory=tuple)
    dry_run: bool = False          # True: the plan only, nothing was written
    roots: tuple[RootRepair, ...] = ()  # the roots that are not intact, by name


@dataclass(frozen=True)
class Stats:
    objects: int
    logical_bytes: int    # sum of uncompressed payload lengths of indexed objects
    stored_bytes: int     # bytes allocated on disk by packs (0 for the memory twin)
    packs: int
    roots: int


class Writer(abc.ABC):
    """A write transaction. Commit on clean ``with`` exit, abort on exception."""

    @abc.abstractmethod
    def put(
        self,
        kind: int,
        payload: bytes | bytearray | memoryview,
        refs: Sequence[bytes] = (),
        *,
        meta: bool = False,
    ) -> bytes:
        """Add an object; return its id. An existing id writes nothing.

        Every ref must name an object that exists (committed or put in this writer).
        ``meta=True`` places the record in a metadata pack (manifest nodes), so gc's mark
        never reads data packs.
        """

    @abc.abstractmethod
    def has(self, oid: bytes) -> bool:
        """True if the object is committed or was put in this writer."""

    def missing(self, oids: Iterable[bytes]) -> set[bytes]:
        """Those of ``oids`` neither committed nor put in this writer (``has`` of each;
        a pack store's writer asks its index once for all)."""
        return {bytes(o) for o in oids if not self.has(o)}

    @property
    @abc.abstractmethod
    def payload_bytes_new(self) -> int:
        """Uncompressed payload bytes of the objects this writer added so far (puts of
        existing ids count nothing): what a caller would otherwise hash twice to learn."""

    @abc.abstractmethod
    def set_root(self, name: str, oid: bytes) -> None:
        """Point root ``name`` at an existing object (visible at commit)."""

    @abc.abstractmethod
    def create_root(self, name: str, oid: bytes) -> None:
        """Like ``set_root``, but create-only: if ``name`` exists when this writer commits
        (checked under the writer lock, inside the publishing transaction), ``commit``
        raises RootExists and NOTHING of this writer becomes visible. Two writers
        creating one name: exactly one wins."""

    @abc.abstractmethod
    def delete_root(self, name: str) -> None:
        """Remove a root (visible at commit). Missing names raise ObjectNotFound."""

    def adopt(self, locs: Sequence[RecordLocation]) -> None:
        """Publish in this commit records another process wrote into packs reserved with
        ``reserve_packs`` (pack stores only; engine/store/adopt.py lists the checks)."""
        raise NotSupported(f"{type(self).__name__} cannot adopt records written elsewhere")

    @abc.abstractmethod
    def commit(self) -> CommitInfo: ...

    @abc.abstractmethod
    def abort(self) -> None: ...

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class ObjectStore(abc.ABC):
    """Read side of a store plus factories for writers and maintenance."""

    @abc.abstractmethod
    def get(self, oid: bytes) -> Object:
        """Read and id-check an object. Raises ObjectNotFound / CorruptObject."""

    def get_many(self, oids: Iterable[bytes]) -> Iterator[Object]:
        for oid in oids:
            yield self.get(oid)

    def prefetch(self, oids: Iterable[bytes]) -> None:  # noqa: B027 - a hint, no-op here
        """Hint that ``oids`` and everything they reach by refs will be read soon: a pack
        store asks the kernel to read their records ahead (a cold restore then reads
        them in parallel, not one small read at a time). Never required, never raises
        for ids the store lacks."""

    def get_into(self, oid: bytes, kind: int, prefix: int, out: memoryview, *,
                 id_check: bool = True, fallback: bool = False) -> bytes | Object | None:
        """Read object ``oid`` (of ``kind``, payload = ``prefix`` bytes + ``len(out)``
        bytes) with its payload after the prefix landing in ``out``; return the prefix.
        None when this store cannot (a compressed record, another kind or size): use
        ``get``. Checks the header against the index and re-hashes refs and payload into the
        id (``id_check=False``: the record checksum instead; the id hash makes it redundant);
        ``out`` is unspecified after an error. Stores without a direct read return None.
        ``fallback=True``: where the direct read does not apply, return ``get(oid)``."""
        return self.get(oid) if fallback else None

    def get_at(self, loc: RecordLocation) -> Object:
        """``get(loc.oid)`` reading first at ``loc``, a location this store's ``locate`` /
        ``locate_closure`` gave (one lookup for many records): no index lookup of its
        own; a location gone stale (a gc moved the record) is looked up again. Checks as
        ``get``."""
        return self.get(loc.oid)

    def get_many_at(self, locs: Sequence[RecordLocation], *, hint: bool = False,
                    views: bool = False) -> list[Object]:
        """``get_at`` of every location in ``locs``, the objects in their order. A pack
        store reads the records lying close together in one pack with one read
        (engine/store/batchread.py) and checks each as ``get_at`` does; errors are
        ``get_at``'s (the first in (pack, offset) order). ``hint``: ask the kernel for
        all of them before the first is read (a cold read of records in many packs).
        ``views``: payloads may be read-only memoryviews of the read (no copy), where
        the caller reads them through the buffer protocol only."""
        return [self.get_at(loc) for loc in locs]

    def get_into_at(self, loc: RecordLocation, kind: int, prefix: int, out: memoryview, *,
                    id_check: bool = True, fallback: bool = False) -> bytes | Object | None:
        """``get_into(loc.oid, ...)`` reading first at ``loc``, as ``get_at``."""
        return self.get_into(loc.oid, kind, prefix, out, id_check=id_check,
                             fallback=fallback)

    def prefetch_at(self, locs: Iterable[RecordLocation]) -> None:  # noqa: B027 - a hint
        """``prefetch`` of the records at ``locs`` alone (no walk of their refs)."""

    @abc.abstractmethod
    def info(self, oid: bytes) -> ObjectInfo:
        """Index entry of an object (kind, refs, sizes) without reading the payload."""

    @abc.abstractmethod
    def has(self, oid: bytes) -> bool: ...

    def missing(self, oids: Iterable[bytes]) -> set[bytes]:
        """Which of ``oids`` the store does not hold."""
        return {bytes(o) for o in oids if not self.has(o)}

    def reserve_packs(self, n: int, *, timeout: float | None = None) -> range:
        """Reserve ``n`` pack numbers for ranks' sinks (pack stores only)."""
        raise NotSupported(f"{type(self).__name__} has no packs to reserve")

    def release_packs(self, packs: range) -> None:
        """End the lease of a ``reserve_packs`` range (pack stores only)."""
        raise NotSupported(f"{type(self).__name__} has no packs to release")

    def locate(self, oids: Iterable[bytes]) -> dict[bytes, RecordLocation]:
        """Where the records of ``oids`` lie (pack stores only); absent ids are left out."""
        raise NotSupported(f"{type(self).__name__} has no record locations")

    def locate_closure(self, oids: Iterable[bytes]) -> dict[bytes, RecordLocation]:
        """``locate`` of ``oids`` and of all they reach by refs (pack stores only)."""
        raise NotSupported(f"{type(self).__name__} has no record locations")

    @abc.abstractmethod
    def root(self, name: str) -> bytes | None: ...

    @abc.abstractmethod
    def roots(self) -> dict[str, bytes]: ...

    @abc.abstractmethod
    def writer(self, *, timeout: float | None = 0.0) -> Writer:
        """Begin a write transaction. Waits up to ``timeout`` seconds (None: forever) for
        another writer to finish, then raises StoreLocked."""

    @abc.abstractmethod
    def gc(
        self,
        *,
        threshold: float = 0.25,
        timeout: float | None = 0.0,
        progress: ProgressFn | None = None,
    ) -> StoreGCReport:
        """Mark from the roots, sweep the rest, and rewrite packs with more than
        ``threshold`` dead bytes. Takes the writer lock."""

    @abc.abstractmethod
    def verify(
        self,
        *,
        deep: bool = False,
        roots: Iterable[str] | None = None,
        progress: ProgressFn | None = None,
    ) -> StoreVerifyReport:
        """Check what the roots (all, or those named) reach: structure always, and with
        ``deep=True`` re-read and re-hash every reachable object."""

    @abc.abstractmethod
    def repair(self, *, dry_run: bool = False) -> RepairReport:
        """Rebuild the index (objects, packs, roots) from the packs alone; never drops a
        root whose DAG still partly reads. ``dry_run``: only scan and report the plan."""

    @abc.abstractmethod
    def stats(self) -> Stats: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

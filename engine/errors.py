"""The engine's exceptions: one tree, so callers catch one base class.

    StoreError                 any failure of the object store
    ├── ObjectNotFound         an id (or root) that the index does not hold
    │   └── PackMoved          a located record's pack is gone (gc moved it): locate again
    ├── CorruptObject          bytes that fail their checksum or id (names pack + offset)
    │   └── GCRefused          gc met a reachable ref it cannot trust and deleted nothing
    ├── StoreLocked            another writer holds the store
    ├── FormatError            an unknown format version or a malformed store layout
    │   ├── StaleIndex         an index behind its packs that could not be brought up to date
    │   └── NoStore            create=False where no store is (directory, shared or bucket)
    ├── RootExists             create_root of a name that exists at commit (nothing published)
    ├── ReadOnly               a write on a store opened with readonly=True
    ├── StoreClosed            use of a closed store, or of a store across fork()
    └── NotSupported           an operation this kind of store cannot do (the memory twin
                               has no packs to reserve, locate or adopt)

Third-party errors (lmdb, zstandard, OSError) are translated at the boundary with
``raise ... from exc``; none escape the engine untranslated.
"""

from __future__ import annotations

__all__ = [
    "StoreError",
    "ObjectNotFound",
    "CorruptObject",
    "StoreLocked",
    "FormatError",
    "StoreClosed",
    "GCRefused",
    "StaleIndex",
    "NoStore",
    "RootExists",
    "ReadOnly",
    "EngineOptionsMismatch",
    "PackMoved",
    "NotSupported",
]


class StoreError(Exception):
    """Base class of every error the engine raises."""


class ObjectNotFound(StoreError, KeyError):
    """The index holds no object (or root) of that name."""

    def __init__(self, message: str, *, oid: bytes | None = None, name: str | None = None):
        super().__init__(message)
        self.oid = oid
        self.name = name

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class PackMoved(ObjectNotFound):
    """A record read by location (engine/store/located.py) is no longer in its pack: the pack
    file is gone (a gc compacted it). Ask the coordinator for the object's location again."""


class NotSupported(StoreError):
    """The store cannot do this at all (e.g. reserve_packs on the in-memory twin)."""


class CorruptObject(StoreError):
    """Stored bytes do not match their checksum or id, or cannot be decoded."""

    def __init__(
        self,
        message: str,
        *,
        oid: bytes | None = None,
        pack: str | None = None,
        offset: int | None = None,
    ):
        super().__init__(message)
        self.oid = oid
        self.pack = pack
        self.offset = offset


class GCRefused(CorruptObject):
    """gc found the reachable graph incomplete or unverifiable (a missing or damaged index
    entry, damaged roots) and deleted nothing: sweeping by it could delete live data.
    ``repair`` rebuilds the index from the packs."""


class StoreLocked(StoreError):
    """Another writer (this or another process) holds the store's writer lock."""


class FormatError(StoreError):
    """The store was written by an unknown format version, or its layout is malformed."""


class StoreClosed(StoreError):
    """The store handle was closed, or is being used in a process it was not opened in."""


class StaleIndex(FormatError):
    """The index is behind (or emptier than) its packs and could not be brought up to date
    here (read-only handle, or the writer lock was unavailable): trusting it would let gc
    delete live packs. Open the store writable, or run repair."""


class NoStore(FormatError):
    """An open with ``create=False`` found no store at the location: nothing was created."""


class RootExists(StoreError):
    """A root created with ``Writer.create_root`` already existed when the writer committed;
    the whole transaction was discarded (its packs are garbage for gc)."""

    def __init__(self, message: str, *, name: str):
        super().__init__(message)
        self.name = name


class CommitSequenceTaken(StoreError):
    """Another writer (on another cache of a bucket store) committed first: this commit's
    sequence number was taken, and nothing of it was published. Retry on a fresh writer."""


class ReadOnly(StoreError):
    """A write (writer, gc, repair) on a store opened with ``readonly=True``."""


class EngineOptionsMismatch(StoreError):
    """An open asked for a value of an option that describes stored data (engine/format/options.py)
    other than the one the store was created with."""

    def __init__(self, message: str, *, name: str, stored: object, asked: object):
        super().__init__(message)
        self.name = name
        self.stored = stored
        self.asked = asked

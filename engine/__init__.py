"""engine: a content-addressed Merkle-DAG object store (bytes in, bytes out).

Knows nothing of tensors: it never imports torch, numpy or cnrstore.

``engine.open(path)`` opens (or creates) the on-disk ``PackStore`` (packs + LMDB index,
specified in docs/FORMAT.md); ``MemoryStore`` is its dict-backed twin. Both implement
``ObjectStore`` (engine/api.py).
"""

from .api import (
    CommitInfo,
    GCReport,
    Object,
    ObjectInfo,
    ObjectStore,
    Problem,
    RepairReport,
    Stats,
    VerifyReport,
    Writer,
)
from .errors import (
    CorruptObject,
    FormatError,
    GCRefused,
    NotSupported,
    ObjectNotFound,
    OptionsMismatch,
    PackMoved,
    ReadOnly,
    RootExists,
    StaleIndex,
    StoreClosed,
    StoreError,
    StoreLocked,
)
from .ids import object_id
from .located import LocatedObjects, LocatedReader
from .location import RecordLocation, decode_locations, encode_locations
from .memory import MemoryStore
from .options import EngineOptions
from .sink import PacksExhausted, PackSink, packs_needed, record_bound
from .store import PackStore, open  # noqa: A004 - engine.open(path) is the entry point

__all__ = [
    "CommitInfo",
    "CorruptObject",
    "EngineOptions",
    "FormatError",
    "GCRefused",
    "GCReport",
    "LocatedObjects",
    "LocatedReader",
    "MemoryStore",
    "Object",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "OptionsMismatch",
    "NotSupported",
    "PackMoved",
    "PackSink",
    "PackStore",
    "PacksExhausted",
    "Problem",
    "ReadOnly",
    "RecordLocation",
    "RepairReport",
    "RootExists",
    "StaleIndex",
    "Stats",
    "StoreClosed",
    "StoreError",
    "StoreLocked",
    "VerifyReport",
    "Writer",
    "decode_locations",
    "encode_locations",
    "object_id",
    "packs_needed",
    "record_bound",
    "open",
]

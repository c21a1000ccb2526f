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
    ObjectNotFound,
    OptionsMismatch,
    ReadOnly,
    RootExists,
    StaleIndex,
    StoreClosed,
    StoreError,
    StoreLocked,
)
from .ids import object_id
from .memory import MemoryStore
from .store import PackStore, open  # noqa: A004 - engine.open(path) is the entry point

__all__ = [
    "CommitInfo",
    "CorruptObject",
    "FormatError",
    "GCRefused",
    "GCReport",
    "MemoryStore",
    "Object",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "OptionsMismatch",
    "PackStore",
    "Problem",
    "ReadOnly",
    "RepairReport",
    "RootExists",
    "StaleIndex",
    "Stats",
    "StoreClosed",
    "StoreError",
    "StoreLocked",
    "VerifyReport",
    "Writer",
    "object_id",
    "open",
]

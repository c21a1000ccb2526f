"""engine: a content-addressed Merkle-DAG object store (bytes in, bytes out).

Knows nothing of tensors: it never imports torch, numpy or cnrstore.

``engine.open(path)`` opens (or creates) the on-disk ``PackStore`` (packs + LMDB index,
specified in docs/FORMAT.md); ``engine.storage_open("s3://bucket/prefix", cache_dir=...)``
a ``PackStore`` whose packs live in a bucket (FORMAT.md "Object stores"); ``MemoryStore``
is its dict-backed twin. All implement ``ObjectStore`` (engine/api.py).
"""

import os
from typing import Any

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
    ConcurrentCommit,
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


def storage_open(url: str, *, cache_dir: str | os.PathLike, storage_options: dict | None = None,
                 **kwargs: Any) -> PackStore:
    """Open the store at ``url`` (``s3://bucket/prefix``; obstore needed) with its index
    cached in ``cache_dir``; other keywords as for ``open``. See engine/storage/s3.py."""
    from .storage.s3 import open_bucket

    store: PackStore = open_bucket(url, cache_dir=cache_dir, storage_options=storage_options,
                                   **kwargs)
    return store

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
    "ConcurrentCommit",
    "StoreLocked",
    "VerifyReport",
    "Writer",
    "object_id",
    "open",
    "storage_open",
]

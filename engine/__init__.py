"""engine: a content-addressed Merkle-DAG object store (bytes in, bytes out).

Knows nothing of tensors: it never imports torch, numpy or cnrstore.

``engine.open(path)`` opens (or creates) the on-disk ``PackStore`` (packs + LMDB index,
specified in docs/FORMAT.md); ``engine.storage_open("s3://bucket/prefix", cache_dir=...)``
a ``PackStore`` whose packs live in a bucket (FORMAT.md "Object stores") or, given a
directory, on a filesystem every host reaches (FORMAT.md "Shared directories"); ``MemoryStore``
is its dict-backed twin. All implement ``ObjectStore`` (engine/api.py).
"""

import os
from typing import Any

from .api import (
    CommitInfo,
    Object,
    ObjectInfo,
    ObjectStore,
    Problem,
    ProgressFn,
    RepairReport,
    RootRepair,
    Stats,
    StoreGCReport,
    StoreVerifyReport,
    Writer,
)
from .errors import (
    CommitSequenceTaken,
    CorruptObject,
    EngineOptionsMismatch,
    FormatError,
    GCRefused,
    NoStore,
    NotSupported,
    ObjectNotFound,
    PackMoved,
    ReadOnly,
    RootExists,
    StaleIndex,
    StoreClosed,
    StoreError,
    StoreLocked,
)
from .format.ids import object_id
from .format.location import RecordLocation, decode_locations, encode_locations
from .format.options import EngineOptions
from .fs import crashpoints
from .fs.fileio import allocated_bytes, atomic_write
from .store.located import LocatedObjects, LocatedReader
from .store.memory import MemoryStore
from .store.packstore import PackStore, open  # noqa: A004 - engine.open(path) is the entry point
from .store.repair import plan_at
from .store.sink import PacksExhausted, PackSink, packs_needed, record_bound
from .store.walk import walk


def storage_open(url: str | os.PathLike, *, cache_dir: str | os.PathLike,
                 storage_options: dict | None = None, **kwargs: Any) -> PackStore:
    """Open the store at ``url`` with its index cached in ``cache_dir`` (a local disk):
    ``s3://bucket/prefix`` (obstore needed; engine/storage/s3.py) or a directory every
    host reaches (engine/storage/shared.py); other keywords as for ``open``."""
    if str(url).startswith("s3://"):
        from .store.opening import open_bucket

        return open_bucket(str(url), cache_dir=cache_dir, storage_options=storage_options,
                           **kwargs)
    from .store.opening import open_shared

    return open_shared(url, cache_dir=cache_dir, storage_options=storage_options, **kwargs)


__all__ = [
    "CommitInfo",
    "CorruptObject",
    "EngineOptions",
    "FormatError",
    "NoStore",
    "GCRefused",
    "StoreGCReport",
    "LocatedObjects",
    "LocatedReader",
    "MemoryStore",
    "Object",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "EngineOptionsMismatch",
    "NotSupported",
    "PackMoved",
    "PackSink",
    "PackStore",
    "PacksExhausted",
    "Problem",
    "ProgressFn",
    "ReadOnly",
    "RecordLocation",
    "RepairReport",
    "RootRepair",
    "RootExists",
    "StaleIndex",
    "Stats",
    "StoreClosed",
    "StoreError",
    "CommitSequenceTaken",
    "StoreLocked",
    "StoreVerifyReport",
    "Writer",
    "allocated_bytes",
    "atomic_write",
    "crashpoints",
    "decode_locations",
    "encode_locations",
    "object_id",
    "packs_needed",
    "plan_at",
    "record_bound",
    "open",
    "storage_open",
    "walk",
]

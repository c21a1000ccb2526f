"""Opening a store whose packs live in a bucket or a shared directory: the storage
(engine/storage/s3.py, shared.py), the bucket commit protocol over it
(engine/store/commit/bucket.py) and a ``PackStore`` whose index caches it."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

from ..errors import FormatError
from ..packs.storage import PackStorage
from ..storage.s3 import attach_bucket, parse_url
from ..storage.shared import attach_shared
from .commit.bucket import Remote
from .packstore import PackStore


def open_bucket(url: str, *, cache_dir: str | os.PathLike,
                storage_options: Mapping[str, Any] | None = None, create: bool = True,
                compression_level: int | None = None, map_size: int | None = None,
                pack_target_size: int | None = None, readonly: bool = False) -> PackStore:
    """Open (or create) the bucket store at ``url`` = ``s3://bucket/prefix``, with its
    index cached in ``cache_dir`` (a local disk: LMDB must not live on a network
    filesystem). Configuration: the AWS_* environment, overridden by ``storage_options``
    (obstore S3 keys, plus ``chunk_size``, ``max_concurrency``, ``gc_grace_s``,
    ``max_retries``, ``retry_timeout_s``, ``timeout_s``)."""
    if cache_dir is None:
        raise FormatError(f"{url}: a bucket store needs a local cache_dir for its index")
    cache = pathlib.Path(cache_dir).absolute()
    parse_url(url)  # a bad location is refused before the cache is touched
    backend, tuning = attach_bucket(url, cache / "staging", storage_options)
    storage = PackStorage(backend)
    remote = Remote(storage, staging=backend.staging, gc_grace_s=tuning["gc_grace_s"])
    return PackStore(cache, create=create, compression_level=compression_level,
                     map_size=map_size, pack_target_size=pack_target_size,
                     readonly=readonly, storage=storage, log=remote)


def open_shared(path: str | os.PathLike, *, cache_dir: str | os.PathLike,
                storage_options: Mapping[str, Any] | None = None, create: bool = True,
                compression_level: int | None = None, map_size: int | None = None,
                pack_target_size: int | None = None, readonly: bool = False) -> PackStore:
    """Open (or create) the shared-directory store at ``path`` with its index cached in
    ``cache_dir`` (a local disk). ``storage_options`` may set ``gc_grace_s`` only."""
    if cache_dir is None:
        raise FormatError(f"{path}: a shared-directory store needs a local cache_dir")
    cache = pathlib.Path(cache_dir).absolute()
    backend, tuning = attach_shared(pathlib.Path(path).absolute(), cache, storage_options,
                                    create=create and not readonly)
    storage = PackStorage(backend)
    remote = Remote(storage, staging=cache / "staging", gc_grace_s=tuning["gc_grace_s"])
    return PackStore(cache, create=create, compression_level=compression_level,
                     map_size=map_size, pack_target_size=pack_target_size,
                     readonly=readonly, storage=storage, log=remote)

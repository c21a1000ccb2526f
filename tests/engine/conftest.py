"""Fixtures shared by the engine tests: every contract test runs against both stores."""

from __future__ import annotations

import itertools

import pytest
from _servers import moto_s3, weed_s3  # noqa: F401 - fixtures, registered by import

import engine


class _WeedStores:
    """``MotoS3.store`` on a SeaweedFS server."""

    def __init__(self, weed) -> None:
        self.weed = weed

    def store(self, cache, **kwargs):
        import uuid

        opts = dict(self.weed.options, **kwargs.pop("storage_options", {}))
        return engine.storage_open(f"s3://{self.weed.bucket}/{uuid.uuid4().hex}",
                                   cache_dir=cache, storage_options=opts, **kwargs)


@pytest.fixture(params=["moto", "shared"])
def bucket(request, tmp_path):
    """What the bucket protocol runs on: moto S3, or a shared directory (engine/storage/
    shared.py); both have ``url()``, ``options`` and ``store(cache, url, **kw)``."""
    if request.param == "moto":
        return request.getfixturevalue("moto_s3")
    from _shared import SharedDirs

    return SharedDirs(tmp_path / "shared")


@pytest.fixture(params=["memory", "pack", "s3", "shared",
                        pytest.param("seaweed", marks=pytest.mark.slow)])
def store_factory(request, tmp_path):
    """A callable returning a fresh store (``MemoryStore``, ``PackStore`` in tmp_path, a
    bucket store on moto, a shared-directory store (packs in one directory, index cached
    in another), or (slow) a bucket store on SeaweedFS, with its cache in tmp_path).

    Keyword options are passed to ``engine.open`` and ignored by the memory twin. Every
    store made is closed at teardown."""
    made = []
    counter = itertools.count()
    server = None
    if request.param == "s3":
        server = request.getfixturevalue("moto_s3")
    elif request.param == "seaweed":
        server = _WeedStores(request.getfixturevalue("weed_s3"))
    elif request.param == "shared":
        from _shared import SharedDirs

        server = SharedDirs(tmp_path / "shared")

    def make(**options):
        if request.param == "memory":
            store = engine.MemoryStore()
        elif server is not None:
            store = server.store(tmp_path / f"cache{next(counter)}", **options)
        else:
            store = engine.open(tmp_path / f"store{next(counter)}", **options)
        made.append(store)
        return store

    make.kind = request.param
    yield make
    for store in made:
        store.close()


@pytest.fixture
def pack_store(tmp_path):
    """A fresh PackStore with small packs (so tests cross pack boundaries cheaply)."""
    store = engine.open(tmp_path / "store", pack_target_size=64 << 10)
    yield store
    store.close()

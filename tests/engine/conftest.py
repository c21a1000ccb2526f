"""Fixtures shared by the engine tests: every contract test runs against both stores."""

from __future__ import annotations

import itertools

import pytest

import engine


@pytest.fixture(params=["memory", "pack"])
def store_factory(request, tmp_path):
    """A callable returning a fresh store (``MemoryStore`` or ``PackStore`` in tmp_path).

    Keyword options are passed to ``engine.open`` and ignored by the memory twin. Every
    store made is closed at teardown."""
    made = []
    counter = itertools.count()

    def make(**options):
        if request.param == "memory":
            store = engine.MemoryStore()
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

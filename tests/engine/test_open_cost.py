"""What an open reads of its LMDB file (benches/results/bench_scaling.md: open time grew
with the index). The damage check before LMDB maps the file (engine/index/lmdbcheck.py)
walks it once per open, not once per layer that opens the index."""

from __future__ import annotations

import os

import pytest

import engine
from engine.index import lmdbcheck


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        for batch in range(4):
            with store.writer() as w:
                leaves = [w.put(1, os.urandom(8) + bytes([batch]) * 40) for _ in range(800)]
                w.set_root(f"r{batch}", w.put(2, b"top", leaves[:50], meta=True))
    return path


def _open_reads(path, monkeypatch, **kwargs) -> tuple[int, int]:
    """(bytes pread from data.mdb, walks of its trees) during one open of ``path``."""
    ino = os.stat(path / "index" / "data.mdb").st_ino
    real_pread, real_walk = os.pread, lmdbcheck._walk_all
    got = [0, 0]

    def pread(fd, n, offset):
        out = real_pread(fd, n, offset)
        if os.fstat(fd).st_ino == ino:
            got[0] += len(out)
        return out

    def walk(*a, **kw):
        got[1] += 1
        return real_walk(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "pread", pread)
        m.setattr(lmdbcheck, "_walk_all", walk)
        store = engine.open(path, **kwargs)
    try:
        assert store.get(store.root("r3")).payload == b"top"
    finally:
        store.close()
    return got[0], got[1]


@pytest.mark.parametrize("readonly", [False, True])
def test_an_open_walks_the_index_file_once(store_path, monkeypatch, readonly):
    data = store_path / "index" / "data.mdb"
    size = os.stat(data).st_size
    assert lmdbcheck.data_file_problem(data) is None and size <= lmdbcheck.OPEN_WALK_ALL_BYTES
    read, walks = _open_reads(store_path, monkeypatch, readonly=readonly)
    assert walks == 1, walks
    # One walk reads each page of the trees at most once: at most the file, and most of
    # it (the objects tree is walked while the file is under OPEN_WALK_ALL_BYTES).
    assert size // 4 < read <= size, (read, size)

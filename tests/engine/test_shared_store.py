"""Shared-directory stores (engine/storage/shared.py): what only a directory shows. The
protocol itself (rebuild, catch-up, races of two processes, gc grace) runs in
test_s3_store.py on the ``bucket`` fixture, the contract suite and a state machine too."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest

import engine
from engine.storage.shared import SharedStorage

WORKER = os.path.join(os.path.dirname(__file__), "_s3_worker.py")
OPTS = {"gc_grace_s": 0.0}


def _open(path, cache, **kw):
    return engine.storage_open(os.fspath(path), cache_dir=cache, storage_options=OPTS, **kw)


def test_kinds_of_directory_store_are_never_mixed(tmp_path):
    shared, plain = tmp_path / "shared", tmp_path / "plain"
    with _open(shared, tmp_path / "cache") as s, s.writer() as w:
        w.set_root("x", w.put(1, b"x"))
    assert not (shared / "index").exists() and (shared / "commits").is_dir()
    with pytest.raises(engine.FormatError, match="shared-directory store"):
        engine.open(shared)
    assert not (shared / "index").exists()  # refused before anything was written
    with engine.open(plain) as p, p.writer() as w:
        w.set_root("y", w.put(1, b"y"))
    with pytest.raises(engine.FormatError, match="its own index"):
        _open(plain, tmp_path / "cache2")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(engine.FormatError, match="not a cnrstore store"):
        _open(tmp_path / "other", tmp_path / "cache3")
    with pytest.raises(engine.FormatError, match="inside the shared store"):
        _open(shared, shared / "cache")
    with pytest.raises(engine.FormatError, match="do not apply"):
        engine.storage_open(os.fspath(shared), cache_dir=tmp_path / "c4",
                            storage_options={"endpoint": "http://127.0.0.1:1"})
    with pytest.raises(engine.FormatError, match="no store"):
        _open(tmp_path / "absent", tmp_path / "c5", create=False)


def test_create_only_leaves_no_temp_file_and_refuses_a_second_create(tmp_path):
    storage = SharedStorage(tmp_path, tmp_path / "staging")
    storage.put_create("commits/00000000000000000001", b"one")
    with pytest.raises(FileExistsError):
        storage.put_create("commits/00000000000000000001", b"two")
    assert storage.get("commits/00000000000000000001") == b"one"
    assert os.listdir(tmp_path / "commits") == ["00000000000000000001"]
    (tmp_path / "commits" / ".00000000000000000002.dead.tmp").write_bytes(b"half")
    assert [k for k, _, _ in storage.listing("commits/")] == ["commits/00000000000000000001"]


def _run(shared, cache, *, env=None, root="r", count=6, size=40_000, seed=0):
    doc = dict(url=os.fspath(shared), cache=str(cache), options=OPTS, cmd="put", root=root,
               count=count, size=size, seed=seed, pack_target_size=64 << 10)
    p = subprocess.run([sys.executable, WORKER, json.dumps(doc)], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout, p.stderr


def _top(root: str, count: int, size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    leaves = [engine.object_id(1, (), rng.randbytes(size)) for _ in range(count)]
    return engine.object_id(2, leaves, root.encode())


@pytest.mark.parametrize("point", ["writer.after_pack_fsync", "writer.after_remote_commit"])
def test_a_writer_killed_mid_commit_leaves_no_half_step(tmp_path, point):
    shared = tmp_path / "shared"
    rc, out, err = _run(shared, tmp_path / "cache", root="base", seed=1)
    assert rc == 0, err
    rc, out, err = _run(shared, tmp_path / "cache", root="dead", seed=2,
                        env={"CNRSTORE_CRASH_AT": point})
    assert rc == -signal.SIGKILL, (rc, out, err)
    visible = point == "writer.after_remote_commit"  # its commit document exists
    for cache in ("cache", "fresh"):  # the dead writer's own cache, and an empty one
        with _open(shared, tmp_path / cache) as s:
            roots = s.roots()
            assert roots["base"] == _top("base", 6, 40_000, 1)
            assert ("dead" in roots) == visible
            if visible:
                assert roots["dead"] == _top("dead", 6, 40_000, 2)
            assert s.verify(deep=True).ok
    with _open(shared, tmp_path / "cache") as s:
        s.gc(threshold=0.0)
        assert set(s.storage.sizes()) == _listed(s)  # the dead writer's packs reclaimed
        assert s.verify(deep=True).ok


def _listed(store) -> set[int]:
    index = store._core.index
    return set(index.read(lambda t: [int.from_bytes(bytes(k), "big") for k in
                                     t.cursor(db=index.packs).iternext(values=False)]))

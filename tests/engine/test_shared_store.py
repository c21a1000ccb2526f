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
from engine.storage.shared import SharedBackend

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
    storage = SharedBackend(tmp_path)
    storage.put_if_absent("commits/00000000000000000001", b"one")
    with pytest.raises(FileExistsError):
        storage.put_if_absent("commits/00000000000000000001", b"two")
    assert storage.get("commits/00000000000000000001") == b"one"
    assert os.listdir(tmp_path / "commits") == ["00000000000000000001"]
    (tmp_path / "commits" / ".00000000000000000002.dead.tmp").write_bytes(b"half")
    assert [o.key for o in storage.list("commits/")] == ["commits/00000000000000000001"]


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


def test_a_creation_stopped_after_its_first_directory_still_opens(tmp_path, monkeypatch):
    """Another process opening a new shared store while this one creates it sees what a
    creation stopped early leaves. It must open: it was refused as "a non-empty
    directory that is not a cnrstore store" when "packs" came before the marker."""
    from engine.storage import shared

    made = []
    real = shared.makedirs_durable

    def stop_after_two(path):
        if len(made) == 2:  # the store's directory, then its first subdirectory
            raise KeyboardInterrupt
        made.append(path)
        real(path)

    monkeypatch.setattr(shared, "makedirs_durable", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        _open(tmp_path / "s", tmp_path / "c1")
    monkeypatch.setattr(shared, "makedirs_durable", real)
    with _open(tmp_path / "s", tmp_path / "c2") as s, s.writer() as w:
        w.set_root("x", w.put(1, b"x"))
    with _open(tmp_path / "s", tmp_path / "c3") as s:
        assert list(s.roots()) == ["x"]


RACE_OPEN = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import engine
base, cache, go, n = sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
while not os.path.exists(go):
    time.sleep(0.001)
for i in range(n):
    with engine.storage_open(os.path.join(base, str(i)), cache_dir=os.path.join(cache, str(i)),
                             storage_options={"gc_grace_s": 0.0}):
        pass
print("ok")
"""


def test_two_processes_creating_the_same_shared_stores_both_open_them(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACE_OPEN, root, str(tmp_path / "s"),
                               str(tmp_path / f"c{k}"), str(go), "40"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [o.strip() for o, _ in outs] == ["ok", "ok"], [e[-2000:] for _, e in outs]

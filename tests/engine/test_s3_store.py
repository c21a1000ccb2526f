"""Bucket stores on moto (loopback), and shared-directory stores (the ``bucket`` fixture
runs each protocol test on both): what the contract suite cannot see with one cache.
An empty cache rebuilds from the bucket, a stale one catches up, commits are create-only
(two writers on two caches, in two processes: exactly one wins), gc deletes only after
its commit and its grace period, and configuration refuses plain http off loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import engine  # noqa: E402
from engine.storage import s3 as s3mod  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "_s3_worker.py")


def _dag(w, name: str, n: int = 3, size: int = 2000) -> tuple[bytes, list[bytes]]:
    leaves = [w.put(1, os.urandom(size)) for _ in range(n)]
    top = w.put(2, name.encode(), leaves, meta=True)
    w.create_root(name, top)
    return top, leaves


def listed_packs(store) -> set[int]:
    index = store._core.index
    return set(index.read(lambda t: [int.from_bytes(bytes(k), "big")
                                     for k in t.cursor(db=index.packs).iternext(values=False)]))


@pytest.fixture
def workers():
    """Worker processes of a test, killed at its end if still running: a test that fails
    before it touches its go file would otherwise leave them polling for it."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def spawn(server, url: str, cache, **args) -> subprocess.Popen:
    doc = dict(url=url, cache=str(cache), options=server.options, **args)
    return subprocess.Popen([sys.executable, WORKER, json.dumps(doc)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_empty_cache_rebuilds_every_committed_root(bucket, tmp_path):
    url = bucket.url()
    with bucket.store(tmp_path / "a", url, pack_target_size=4096) as a:
        tops = {}
        for i in range(4):
            with a.writer() as w:
                tops[f"r{i}"], _ = _dag(w, f"r{i}")
        with a.writer() as w:
            w.delete_root("r1")
        del tops["r1"]
    with bucket.store(tmp_path / "b", url) as b:
        assert b.roots() == tops
        assert b.verify(deep=True).ok
        assert b.stats().objects == 4 * 4  # dead objects stay until a gc sweeps them


def test_stale_cache_catches_up_and_never_serves_a_collected_root(bucket, tmp_path):
    url = bucket.url()
    a = bucket.store(tmp_path / "a", url)
    with a.writer() as w:
        old, old_leaves = _dag(w, "old")
    a.close()
    b = bucket.store(tmp_path / "b", url)
    with b.writer() as w:
        w.delete_root("old")
        new, _ = _dag(w, "new")
    b.gc(threshold=0.0)
    b.close()
    a = bucket.store(tmp_path / "a", url)  # stale: it last saw "old"
    assert a.roots() == {"new": new}
    assert not a.has(old) and not any(a.has(x) for x in old_leaves)
    with pytest.raises(engine.ObjectNotFound):
        a.get(old)
    assert a.verify(deep=True).ok
    a.close()


def test_an_open_stale_handle_finds_moved_objects_again(bucket, tmp_path):
    """gc on another cache rewrites a pack; a reader holding the old location catches up
    when the pack is gone and reads the object from its new pack."""
    url = bucket.url()
    a = bucket.store(tmp_path / "a", url, pack_target_size=1 << 20)
    with a.writer() as w:
        keep, keep_leaves = _dag(w, "keep")
        _dag(w, "drop")  # same packs: dropping it leaves them mostly dead
    b = bucket.store(tmp_path / "b", url)
    with b.writer() as w:
        w.delete_root("drop")
    report = b.gc(threshold=0.1)  # grace 0: the old packs go at once
    assert report.packs_rewritten >= 1
    for leaf in keep_leaves:
        assert len(a.get(leaf).payload) == 2000  # old location gone: caught up, found
    assert a.roots() == {"keep": keep}
    a.close()
    b.close()


def test_gc_keeps_retired_packs_for_the_grace_period(bucket, tmp_path):
    url = bucket.url()
    slow = {"gc_grace_s": 3600.0}
    a = bucket.store(tmp_path / "a", url)
    with a.writer() as w:
        _, leaves = _dag(w, "x")
    b = bucket.store(tmp_path / "b", url, storage_options=slow)
    with b.writer() as w:
        w.delete_root("x")
    report = b.gc(threshold=0.0)
    assert report.objects_freed == 4 and report.packs_deleted == 0
    # A reader that still holds the old locations reads them through the grace period.
    assert len(a.get(leaves[0]).payload) == 2000
    b.close()
    b = bucket.store(tmp_path / "b", url)  # grace 0 now: the next gc deletes them
    before = set(b._core.storage.sizes())
    assert b.gc(threshold=0.0).packs_deleted == 2
    left = set(b._core.storage.sizes())
    assert len(before - left) == 2 and len(left) == b.stats().packs  # only listed ones
    b.close()
    a.close()


def test_two_writers_on_two_caches_race_for_one_root(bucket, tmp_path, workers):
    url = bucket.url()
    go = tmp_path / "go"
    procs = [spawn(bucket, url, tmp_path / f"c{i}", cmd="put", root="step/7", count=3,
                   size=50_000, go=str(go)) for i in range(2)]
    workers.extend(procs)
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    go.touch()
    results = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert results == ["RootExists", "ok"], results
    with bucket.store(tmp_path / "check", url) as s:
        assert list(s.roots()) == ["step/7"]
        assert s.verify(deep=True).ok
        s.gc(threshold=0.0)
        # The loser's packs were deleted by its abort; only indexed packs are left.
        assert set(s._core.storage.sizes()) == listed_packs(s)


def test_two_writers_of_different_roots_one_gets_concurrent_commit(bucket, tmp_path, workers):
    url = bucket.url()
    go = tmp_path / "go"
    procs = [spawn(bucket, url, tmp_path / f"c{i}", cmd="put", root=f"step/{i}", count=2,
                   size=1000, go=str(go)) for i in range(2)]
    workers.extend(procs)
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    go.touch()
    results = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert results == ["CommitSequenceTaken", "ok"], results
    with bucket.store(tmp_path / "check", url) as s:
        assert len(s.roots()) == 1
        assert s.verify(deep=True).ok


def test_pack_numbers_are_claimed_across_caches(bucket, tmp_path):
    """Two caches that believe the same next pack number never write the same object."""
    url = bucket.url()
    a = bucket.store(tmp_path / "a", url)
    b = bucket.store(tmp_path / "b", url)
    wa, wb = a.writer(), b.writer()
    xa, xb = wa.put(1, b"a" * 100), wb.put(1, b"b" * 100)
    wa.set_root("a", xa)
    wb.set_root("b", xb)
    numbers = {pf.number for pf in wa._packs.files} | {pf.number for pf in wb._packs.files}
    assert len(numbers) == 2
    wa.commit()
    with pytest.raises(engine.CommitSequenceTaken):
        wb.commit()
    assert b.roots() == {"a": xa}  # the loser's cache caught up
    with b.writer() as w:  # and its next writer commits on top
        w.set_root("b", w.put(1, b"b" * 100))
    assert set(bucket.store(tmp_path / "c", url).roots()) == {"a", "b"}
    a.close()
    b.close()


def test_a_cache_belongs_to_one_location(bucket, tmp_path):
    with bucket.store(tmp_path / "a", bucket.url("one")) as s, s.writer() as w:
        w.set_root("x", w.put(1, b"x"))
    with pytest.raises(engine.FormatError, match="belongs to"):
        bucket.store(tmp_path / "a", bucket.url("two"))
    with pytest.raises(engine.FormatError, match="no store"):
        bucket.store(tmp_path / "b", bucket.url("three"), create=False)


def test_plain_http_only_to_loopback_or_when_allowed(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://10.1.2.3:9000")
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    with pytest.raises(engine.FormatError, match="plain http"):
        s3mod.resolve_options({})
    config, _ = s3mod.resolve_options({"allow_http": "true"})
    assert config["_allow_http"] is True
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert s3mod.resolve_options({})[0]["endpoint"] == "http://10.1.2.3:9000"
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    for endpoint in ("http://127.0.0.1:9000", "http://localhost:1", "http://[::1]:2"):
        assert s3mod.resolve_options({"endpoint": endpoint})[0]["_allow_http"] is True
    config, tuning = s3mod.resolve_options({"endpoint": "https://s3.example.com",
                                            "gc_grace_s": 5, "region": "eu-west-1"})
    assert config["region"] == "eu-west-1" and tuning["gc_grace_s"] == 5.0
    assert config["_allow_http"] is False


def test_bucket_url_parsing():
    assert s3mod.parse_url("s3://b/p/q/") == ("b", "p/q")
    assert s3mod.parse_url("s3://b") == ("b", "")
    with pytest.raises(engine.FormatError):
        s3mod.parse_url("gs://b/p")


def test_many_commits_replay_in_order_on_an_empty_cache(bucket, tmp_path):
    """Documents are fetched in parallel; they must apply in sequence order (a root
    moved 30 times ends at its last target)."""
    url = bucket.url()
    with bucket.store(tmp_path / "a", url) as a:
        for i in range(30):
            with a.writer() as w:
                w.set_root("moving", w.put(1, f"v{i}".encode()))
                if i % 7 == 0:
                    w.set_root(f"kept{i}", w.put(1, f"k{i}".encode()))
        want = a.roots()
        a.gc(threshold=0.0)
    with bucket.store(tmp_path / "b", url) as b:
        assert b.roots() == want
        assert b.get(want["moving"]).payload == b"v29"
        assert b.verify(deep=True).ok
        assert b.stats().objects == len(want)  # the gc's swept ids were replayed too


def test_a_readonly_handle_catches_up_but_refuses_writes(bucket, tmp_path):
    url = bucket.url()
    with bucket.store(tmp_path / "a", url) as a, a.writer() as w:
        w.set_root("x", w.put(1, b"x"))
    with bucket.store(tmp_path / "b", url, readonly=True) as b:
        assert set(b.roots()) == {"x"}
        for call in (b.writer, b.gc, b.repair):
            with pytest.raises(engine.ReadOnly):
                call()


def test_a_commit_slower_than_the_gc_grace_is_refused(bucket, tmp_path):
    """A gc elsewhere deletes unlisted packs once gc_grace_s old: a writer whose packs
    may be that old must not publish a commit naming them."""
    url = bucket.url()
    with bucket.store(tmp_path / "a", url, storage_options={"gc_grace_s": 0.5}) as a:
        w = a.writer()
        w.set_root("slow", w.put(1, b"slow" * 100))
        time.sleep(0.6)
        with pytest.raises(engine.StoreError, match="gc_grace_s"):
            w.commit()
        assert a.roots() == {}
        assert a._core.storage.sizes() == {}  # nothing published: its packs deleted
        with a.writer() as w:  # a prompt one commits
            w.set_root("fast", w.put(1, b"fast"))
        assert set(a.roots()) == {"fast"}

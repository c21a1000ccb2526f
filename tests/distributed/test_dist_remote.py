"""Many ranks on a bucket (moto, and SeaweedFS in a slow test) and on a shared directory
(issues 11 and 13): only the coordinator opens an index, in its cache_dir; every other
rank reaches the packs from the coordinator's locator, writes them through the storage
and reads by location. A distributed put stores exactly the objects of a single-process
put; a fresh cache rebuilt from the commit documents restores the steps exactly; any
world size restores; a rank SIGKILLed mid-put leaves no step, and gc reclaims its packs."""

from __future__ import annotations

import os

import pytest
import torch
from dist_util import BLOCK_ROWS, FANOUT, Failed, oracle, put_sequence, run, sequence, survivors
from dist_workers import _table, killed, layouts, restore_layouts, save_layouts

import cnrstore
from engine.packs.pack import pack_name

pytest.importorskip("obstore")


@pytest.fixture(params=["shared", "moto"])
def where(request, tmp_path):
    """A store location for ranks: a shared directory, or a prefix of the moto bucket;
    ``cache`` is per rank ("host"): only rank 0's may ever exist."""
    cache = os.fspath(tmp_path / "host{rank}" / "cache")
    if request.param == "shared":
        return {"path": os.fspath(tmp_path / "shared"), "cache": cache,
                "options": {"gc_grace_s": 0.0}}
    server = request.getfixturevalue("moto_s3")
    return {"path": server.url(), "cache": cache, "options": server.options}


def _open_single(where, cache, **kw):
    return cnrstore.open(where["path"], cache_dir=cache, storage_options=where["options"],
                         block_rows=BLOCK_ROWS, fanout=FANOUT, **kw)


def _only_rank0_cache(tmp_path, world):
    assert (tmp_path / "host0" / "cache").is_dir()
    for r in range(1, world):
        assert not (tmp_path / f"host{r}").exists(), f"rank {r} touched a cache_dir"


@pytest.mark.parametrize("world", [1, 2])
def test_distributed_put_equals_a_single_process_put_and_a_fresh_cache_rebuilds(
        where, tmp_path, world):
    seed = 11
    want = oracle(os.fspath(tmp_path / "oracle"), seed)
    got = run(world, put_sequence, where, seed, timeout=120)
    for r, ids in enumerate(got):
        assert not isinstance(ids, Failed), ids.trace
        assert ids == want, f"rank {r}"
    _only_rank0_cache(tmp_path, world)
    step, tables, quant = sequence(seed)[-1]
    with cnrstore.open(tmp_path / "oracle") as o:
        expect = {s: o.get_tables(s) for s in o.steps()}
    # An empty cache on another "host": rebuilt from the commit documents alone.
    with _open_single(where, tmp_path / "fresh") as s:
        assert s.steps() == [10, 20, 30]
        for st, tabs in expect.items():
            back = s.get_tables(st)
            for name, t in tabs.items():
                assert torch.equal(back[name], t), (st, name)
        assert s.verify().ok
    for name, t in tables.items():
        if quant.get(name, "exact") == "exact":
            assert torch.equal(expect[step][name], t), name


# moto under -m slow: the other tests of this file run the bucket path on moto by default.
@pytest.mark.parametrize("where", ["shared", pytest.param("moto", marks=pytest.mark.slow)],
                         indirect=True)
def test_restore_at_another_world_size(where, tmp_path):
    res = run(2, save_layouts, where, timeout=120)
    assert all(r is True for r in res), res
    where3 = dict(where, cache=os.fspath(tmp_path / "later{rank}" / "cache"))
    for r, res in enumerate(run(3, restore_layouts, where3, timeout=120)):
        assert not isinstance(res, Failed), res.trace
        ok, whole = res
        assert whole and all(all(v) for v in ok.values()), (r, ok)
    assert not (tmp_path / "later1").exists() and not (tmp_path / "later2").exists()
    with _open_single(where, tmp_path / "one") as s:  # one process, no group
        for name, t in layouts(2).items():
            assert torch.equal(s.get_tables(2)[name], t), name


@pytest.mark.parametrize("victim,point", [(1, "dist.rank_after_seal"),
                                          (0, "dist.coord_before_commit")])
def test_a_rank_killed_mid_put_leaves_no_step_and_gc_reclaims_its_packs(
        where, tmp_path, victim, point):
    res = run(2, killed, where, victim, point, timeout=90, expect_dead=(victim,))
    survivors(res, victim)
    # The coordinator's own cache (if it survived) and a fresh one agree.
    for cache in {tmp_path / "host0" / "cache", tmp_path / "fresh"}:
        with _open_single(where, cache) as s:
            assert s.steps() == [1]
            assert torch.equal(s.get_tables(1)["t"], _table(1))
            assert s.verify().ok
    with _open_single(where, tmp_path / "fresh") as s:
        s.gc(threshold=0.0)  # gc_grace_s is 0 in the tests: the orphans go at once
        storage = s.objects.storage
        assert len(storage.sizes()) == s.objects.stats().packs  # only listed packs left
        assert s.verify().ok
        assert torch.equal(s.get_tables(1)["t"], _table(1))


def test_a_shared_store_refuses_the_wrong_kind_of_open(tmp_path):
    with cnrstore.open(tmp_path / "shared", cache_dir=tmp_path / "c") as s:
        s.put_tables(1, {"t": _table(1)})
    with pytest.raises(cnrstore.CheckpointError, match="shared-directory store"):
        cnrstore.open(tmp_path / "shared")
    with cnrstore.open(tmp_path / "plain") as s:
        s.put_tables(1, {"t": _table(1)})
    with pytest.raises(cnrstore.CheckpointError, match="its own index"):
        cnrstore.open(tmp_path / "plain", cache_dir=tmp_path / "c2")


@pytest.mark.slow
def test_group_put_and_restore_on_seaweedfs(weed_s3, tmp_path):
    where = {"path": f"s3://{weed_s3.bucket}/dist-{os.urandom(4).hex()}",
             "cache": os.fspath(tmp_path / "host{rank}" / "cache"), "options": weed_s3.options}
    seed = 5
    want = oracle(os.fspath(tmp_path / "oracle"), seed)
    for r, ids in enumerate(run(3, put_sequence, where, seed, timeout=240)):
        assert not isinstance(ids, Failed), ids.trace
        assert ids == want, f"rank {r}"
    _only_rank0_cache(tmp_path, 3)
    with cnrstore.open(tmp_path / "oracle") as o:
        expect = o.get_tables(30)
    with _open_single(where, tmp_path / "fresh") as s:
        back = s.get_tables(30)
        for name, t in expect.items():
            assert torch.equal(back[name], t), name
        assert s.verify().ok


@pytest.mark.parametrize("retry", [True, False])
def test_a_rank_meeting_a_moved_pack_reads_again_with_fresh_locations(where, tmp_path,
                                                                      retry):
    """A gc by another job (another cache, grace 0) compacts the packs a rank was just
    given locations in: that rank meets a gone pack and makes every rank read again after
    the coordinator caught up. (retry=False shows the failure the retry exists for.)"""
    from remote_workers import moved_read

    res = run(2, moved_read, where, os.fspath(tmp_path / "otherjob"), retry, timeout=120)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    seen = res[1][2]
    # The premise: rank 1's locations named packs that existed, and the gc rewrote and
    # deleted at least one of them before rank 1 read.
    gone = seen["given"] - seen["after"]
    assert seen["given"] and seen["given"] <= seen["before"], seen
    assert gone and min(seen["gc"]) >= 1, seen
    if retry:
        assert [r[:2] for r in res] == [(("ok", True), 2)] * 2, res  # read twice, right
    else:
        assert res[0][0][0] == "error" and res[0][:2] == res[1][:2], res
        message = res[1][0][2]
        assert "locate it again" in message, res
        assert any(pack_name(n) in message for n in gone), (message, gone)
        assert res[1][1] == 1, res


def test_only_the_coordinator_lists_the_storage(where, tmp_path):
    from dist_workers import count_listings

    counts = run(2, count_listings, where, 5, timeout=120)
    for c in counts:
        assert not isinstance(c, Failed), c.trace
    assert counts[0] > 0 and counts[1] == 0, counts

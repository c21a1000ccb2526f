"""A checkpoint store on a shared directory (packs and commit documents on a filesystem
every host mounts, each host's index a cache of its own): two processes on two caches
racing for one step, exactly one wins; an empty cache sees every step; a stale cache
catches up and never serves a collected step."""

from __future__ import annotations

import os

import torch
from ckpt_util import race_writers

import cnrstore

OPTS = {"gc_grace_s": 0.0}


def _open(path, cache):
    return cnrstore.open(os.fspath(path), cache_dir=cache, storage_options=OPTS)


def test_two_processes_on_two_caches_race_for_one_step(tmp_path):
    shared, go = os.fspath(tmp_path / "shared"), tmp_path / "go"
    with _open(shared, tmp_path / "c0") as s:
        s.put_tables(1, {"t": torch.zeros(10, 8)})
    docs = [{"url": shared, "cache": str(tmp_path / f"c{i}"), "options": OPTS,
             "step": 7, "rows": 4000, "seed": i, "go": str(go)} for i in range(2)]
    outs = race_writers(docs, go)
    results = sorted(out.strip() for out, _ in outs)
    assert results == ["StepExists", "ok"], outs
    winner = next(i for i, (out, _) in enumerate(outs) if out.strip() == "ok")
    expect = torch.randn(4000, 8, generator=torch.Generator().manual_seed(winner))
    for cache in ("c0", "c1", "fresh"):  # both racers' caches and an empty one agree
        with _open(shared, tmp_path / cache) as s:
            assert s.steps() == [1, 7]
            assert torch.equal(s.get_tables(7)["t"], expect)
            assert s.verify(deep=True).ok


def test_a_stale_cache_never_serves_a_collected_step(tmp_path):
    shared = tmp_path / "shared"
    t = torch.randn(500, 8)
    with _open(shared, tmp_path / "a") as a:
        a.put_tables(1, {"t": t})
        a.put_tables(2, {"t": t + 1})
    with _open(shared, tmp_path / "b") as b:
        b.delete_step(1)
        b.gc()
        b.put_tables(3, {"t": t + 3})
    with _open(shared, tmp_path / "a") as a:  # last saw steps 1 and 2
        assert a.steps() == [2, 3]
        assert torch.equal(a.get_tables(3)["t"], t + 3)
        assert a.verify(deep=True).ok
    with _open(shared, tmp_path / "empty") as e:
        assert e.steps() == [2, 3]
        assert torch.equal(e.get_tables(2)["t"], t + 1)

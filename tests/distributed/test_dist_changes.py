"""DistributedStore.changes (issue 28) with 2 spawned gloo ranks on a directory, a shared
directory and a moto bucket: each rank gets the changes of its own row range, the same
as a single process computes for that range; a bad request on one rank fails on all."""

from __future__ import annotations

import os

import pytest
import torch
from changes_workers import served_changes
from dist_util import BLOCK_ROWS, FANOUT, Failed, run

import cnrstore


@pytest.fixture(params=["dir", "shared", "moto"])
def where(request, tmp_path):
    if request.param == "dir":
        return os.fspath(tmp_path / "store")
    pytest.importorskip("obstore")
    cache = os.fspath(tmp_path / "host{rank}" / "cache")
    if request.param == "shared":
        return {"path": os.fspath(tmp_path / "shared"), "cache": cache,
                "options": {"gc_grace_s": 0.0}}
    server = request.getfixturevalue("moto_s3")
    return {"path": server.url(), "cache": cache, "options": server.options}


def _single(where, tmp_path):
    if isinstance(where, str):
        return cnrstore.open(where, block_rows=BLOCK_ROWS, fanout=FANOUT)
    return cnrstore.open(where["path"], cache_dir=tmp_path / "fresh",
                         storage_options=where["options"], block_rows=BLOCK_ROWS,
                         fanout=FANOUT)


@pytest.mark.parametrize("where", ["dir", "shared", pytest.param("moto", marks=pytest.mark.slow)],
                         indirect=True)
def test_each_rank_gets_the_changes_of_its_rows(where, tmp_path):
    res = run(2, served_changes, where, timeout=120)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    with _single(where, tmp_path) as s:
        for rank, (lo, hi) in enumerate([(0, 100), (100, 200)]):
            got = res[rank]
            assert (got["missing"], got["table"]) == ("StepNotFound", "TableNotFound")
            assert got[(3, 3)] == []
            for pair in ((1, 3), (3, 1), (2, 3)):
                want = [(c.table, c.kind, c.rows.tolist(), c.values)
                        for c in s.changes(*pair, rows={"t": slice(lo, hi)})]
                assert [g[:3] for g in got[pair]] == [w[:3] for w in want], (rank, pair)
                for g, w in zip(got[pair], want):
                    assert torch.equal(g[3], w[3])
                rows = [r for t, _, rs, _ in got[pair] if t == "t" for r in rs]
                assert rows and all(lo <= r < hi for r in rows), (rank, pair, rows)
            b = s.get_tables(3)["t"]
            vals = {r: v for t, _, rs, vs in got[(1, 3)] if t == "t"
                    for r, v in zip(rs, vs)}
            assert all(torch.equal(v, b[r]) for r, v in vals.items())

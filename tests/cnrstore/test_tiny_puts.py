"""Many tiny puts (issue 23 item 16): each put writes its own data and meta pack, and gc
merges the small ones, so the steps end up in a handful of files, all restoring exactly."""

from __future__ import annotations

import pathlib

import torch
from ckpt_util import assert_identical

import cnrstore


def test_gc_packs_many_tiny_steps_into_a_few_files(tmp_path):
    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(3)
    t = torch.randn(64, 16, generator=g)
    want = {}
    with cnrstore.open(path) as store:
        for step in range(100):
            t[step % 64] += 1.0
            want[step] = t.clone()
            store.put_tables(step, {"emb": want[step]})
        packs = lambda: sorted(pathlib.Path(path, "packs").rglob("*.pack"))  # noqa: E731
        assert len(packs()) >= 200
        store.gc()
        assert len(packs()) <= 2
        assert store.verify().ok
        for step, table in want.items():
            assert_identical(store.get_tables(step)["emb"], table)

"""The demo's serving copy (cnrstore/demo/serving.py) follows a store by changes only:
every published step equals the store's, across a rollback and a lossy scheme, and the
changes cost a fraction of full copies."""

from __future__ import annotations

import torch

import cnrstore
from cnrstore.demo import serving


def test_serving_copy_follows_the_store_by_changes(tmp_path):
    g = torch.Generator().manual_seed(0)
    emb, top = torch.randn(3000, 16, generator=g), torch.randn(8, 4, generator=g)
    with cnrstore.open(tmp_path / "s", block_rows=256) as store:
        for step in range(7):
            emb[torch.randint(0, 3000, (40,), generator=g)] += 0.1
            top += 0.01
            store.put_state(step, {"model": {"emb": emb, "top": top},
                                   "optim": {"sum": emb.abs()}},
                            quant={"model/emb": "int8" if step > 3 else "exact"})
            if step == 4:
                store.rollback(3)  # the serving copy follows the branch that is kept
        assert store.steps() == [0, 1, 2, 3, 5, 6]
        got = serving.follow(store, every=2)
    assert got.steps == (0, 2, 5, 6) and got.identical
    assert 0 < got.rows and got.bytes_sent < got.bytes_full / 2
    assert "identical to the store at every step" in got.line()

"""A restore reads each block and its patch chain at the locations one
``locate_closure`` found (cnrstore/core/blockread.py ``_chain_reads``): the latest step of a
chain of incremental puts restores bit-identical, returned and in place, exact and int8,
also for row slices and after a gc rewrote packs under a store kept open."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cnrstore


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 700), width=st.integers(1, 9), steps=st.integers(1, 4),
       frac=st.floats(0.0, 0.5), seed=st.integers(0, 999), quant=st.sampled_from(["exact",
                                                                                 "int8"]))
def test_latest_of_a_patch_chain_restores(tmp_path_factory, rows, width, steps, frac, seed,
                                          quant):
    rng = np.random.default_rng(seed)
    t = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32))
    path = tmp_path_factory.mktemp("s") / "store"
    with cnrstore.open(path, block_rows=64) as s:
        s.put_tables(0, {"t": t}, quant=quant)
        for step in range(1, steps + 1):
            k = int(frac * rows)
            idx = torch.from_numpy(rng.choice(rows, size=k, replace=False))
            t[idx] += torch.from_numpy(rng.standard_normal((k, width)).astype(np.float32))
            s.put_tables(step, {"t": t}, quant=quant)
        got = s.get_tables()["t"]
        out = torch.full_like(t, float("nan"))
        s.get_tables(out={"t": out})
        lo, hi = rows // 3, rows - rows // 4
        part = s.get_tables(rows={"t": slice(lo, hi)})["t"]
        if quant == "exact":
            assert torch.equal(got.view(torch.int32), t.view(torch.int32))
            assert torch.equal(out.view(torch.int32), t.view(torch.int32))
            assert torch.equal(part.view(torch.int32), t[lo:hi].view(torch.int32))
        else:
            assert torch.equal(got, out)
            assert torch.equal(part, got[lo:hi])
            span = (t.amax(dim=1, keepdim=True) - t.amin(dim=1, keepdim=True)) / 100 + 1e-4
            assert bool(((got - t).abs() <= span).all())


def test_restore_after_gc_rewrote_packs(tmp_path):
    rng = np.random.default_rng(1)
    t = torch.from_numpy(rng.standard_normal((500, 8)).astype(np.float32))
    with cnrstore.open(tmp_path / "store", block_rows=64) as s:
        for step in range(6):
            t[torch.from_numpy(rng.choice(500, 40, replace=False))] += 1.0
            s.put_tables(step, {"t": t})
            if step == 4:
                kept = t.clone()
        s.delete_steps([0, 1, 2])
        s.gc(threshold=0.0)
        assert torch.equal(s.get_tables(5)["t"].view(torch.int32), t.view(torch.int32))
        assert torch.equal(s.get_tables(4)["t"].view(torch.int32), kept.view(torch.int32))

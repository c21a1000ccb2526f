"""The grouped layout's ids do not depend on the timing (docs/ARCHITECTURE.md,
"Determinism"): non-blocking puts queued while the one before is still being written
store the ids of puts that each waited for the one before. A block version names the full
list its delta counts against (``ListedVersion.base``), and writing a version may set a
new one: a version planned while its predecessor was queued took the older base."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cnrstore

OPTS = {"block_rows": 64, "fanout": 4, "layout": "grouped"}


def _run(path, scheme: str, wait: bool) -> list[dict]:
    rng = np.random.default_rng(3)
    g = torch.Generator().manual_seed(3)
    t = torch.rand(300, 4, generator=g) * 6 - 3
    futs = []
    with cnrstore.open(path, **OPTS) as s:
        futs.append(s.put_tables(0, {"t": t}, quant=scheme, blocking=False))
        for step in range(1, 16):
            if wait:
                futs[-1].result(timeout=60)
            rows = torch.from_numpy(np.unique(rng.zipf(1.4, size=30) * 7 % 300))
            # In place, as training does once a non-blocking put returned.
            t[rows] += torch.rand(len(rows), 4, generator=g) - 0.5
            futs.append(s.put_tables(step, {"t": t}, quant=scheme, blocking=False,
                                     touched={"t": rows}))
        ids = [f.result(timeout=60).tables for f in futs]
        assert s.verify().ok
        if scheme == "exact":
            assert torch.equal(s.get_tables(15)["t"], t)
    return ids


@pytest.mark.parametrize("scheme", ["exact", "int8"])
def test_queued_puts_store_the_ids_of_puts_that_waited(tmp_path, scheme):
    assert _run(tmp_path / "q", scheme, wait=False) == _run(tmp_path / "w", scheme, wait=True)

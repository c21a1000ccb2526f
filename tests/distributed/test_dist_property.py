"""Property: any tiling of a table over the ranks (uneven, empty, several pieces per rank,
not aligned with blocks) gives the table ids of a single-process put (Hypothesis; each
example spawns the ranks, so few examples, and only in the slow suite)."""

from __future__ import annotations

import pytest
from dist_util import Failed, run
from dist_workers import tiling_put, tiling_tables
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cnrstore


@st.composite
def tilings(draw):
    world = draw(st.integers(2, 3))
    rows = draw(st.integers(0, 120))
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=world * 2 - 1,
                                max_size=world * 2 - 1)))
    bounds = [0, *cuts, rows]
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for i in range(len(bounds) - 1):  # piece i to a drawn rank: interleaved, uneven
        if bounds[i + 1] > bounds[i]:
            pieces[draw(st.integers(0, world - 1))].append((bounds[i], bounds[i + 1]))
    return {"world": world, "rows": rows, "pieces": pieces,
            "block_rows": draw(st.sampled_from([5, 16, 32])),
            "quant": draw(st.sampled_from(["exact", "int8"])),
            "seed": draw(st.integers(0, 1000))}


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=tilings())
def test_any_tiling_gives_single_process_ids(tmp_path_factory, spec):
    tmp = tmp_path_factory.mktemp("tiling")
    with cnrstore.open(tmp / "o", block_rows=spec["block_rows"], fanout=3) as o:
        want = [o.put_tables(step, {"t": tiling_tables(spec["rows"], spec["seed"], step)},
                             quant=spec["quant"]).tables for step in (1, 2)]
    for r in run(spec["world"], tiling_put, str(tmp / "d"), spec):
        assert not isinstance(r, Failed), r.trace
        assert r == want, spec

"""The long-run write policy (merged patches, staggered bounds; core/chainpolicy.py) gives
the ids of a single-process put at any world size, merges included."""

from __future__ import annotations

import pytest
from dist_util import Failed, run
from longrun_workers import OPTS, STEPS, longrun_put, longrun_tables

import cnrstore
from cnrstore.format.load import load_manifest


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_merged_chains_give_single_process_ids(tmp_path, world):
    with cnrstore.open(tmp_path / "o", **OPTS) as o:
        want = [o.put_tables(step, {"t": longrun_tables(step)}).tables
                for step in range(STEPS)]
        depths = [load_manifest(o.objects, step).tables["t"].depth for step in range(STEPS)]
    # Some block's chain went back to depth 1 without a full rewrite: a merged patch.
    assert any(b == 1 and a >= 1 for d0, d1 in zip(depths, depths[1:])
               for a, b in zip(d0, d1))
    for r in run(world, longrun_put, str(tmp_path / "d")):
        assert not isinstance(r, Failed), r.trace
        assert r == want, f"world {world}"
    with cnrstore.open(tmp_path / "d") as d:
        for step in range(STEPS):
            assert bool((d.get_tables(step)["t"] == longrun_tables(step)).all())


def test_grouped_lists_give_single_process_ids(tmp_path):
    """The grouped layout's classes and cleaning depend on each block's own history, so
    a world of 2 writes the ids one process does."""
    from longrun_workers import GROUPED, grouped_put

    with cnrstore.open(tmp_path / "o", **GROUPED) as o:
        want = [o.put_tables(step, {"t": longrun_tables(step)}).tables
                for step in range(STEPS)]
    for r in run(2, grouped_put, str(tmp_path / "d")):
        assert not isinstance(r, Failed), r.trace
        assert r == want
    with cnrstore.open(tmp_path / "d") as d:
        assert d.options.layout == "grouped"
        for step in range(STEPS):
            assert bool((d.get_tables(step)["t"] == longrun_tables(step)).all())
        assert d.verify(deep=True).ok

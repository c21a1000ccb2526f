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


@pytest.mark.parametrize("wide", [False, True])
def test_grouped_lists_give_single_process_ids(tmp_path, wide):
    """The grouped layout's classes and cleaning depend on each block's own history, so
    a world of 2 writes the ids one process does; also where a version lists objects of
    earlier steps again (``wide``), which a rank cannot look up in the store."""
    from longrun_workers import GROUPED, GROUPED_WIDE, grouped_put

    from cnrstore.format.rowlists import read_list

    opts = GROUPED_WIDE if wide else GROUPED
    with cnrstore.open(tmp_path / "o", **opts) as o:
        want = [o.put_tables(step, {"t": longrun_tables(step)}).tables
                for step in range(STEPS)]
        if wide:
            last = load_manifest(o.objects, STEPS - 1).tables["t"].block_ids
            steps = {int(s) for b in last for s in read_list(o.objects.get, b).steps}
            assert steps - {0, STEPS - 1}, "no object outlived its step"
    for r in run(2, grouped_put, str(tmp_path / "d"), opts):
        assert not isinstance(r, Failed), r.trace
        assert r == want
    with cnrstore.open(tmp_path / "d") as d:
        assert d.options.layout == "grouped"
        for step in range(STEPS):
            assert bool((d.get_tables(step)["t"] == longrun_tables(step)).all())
        assert d.verify(deep=True).ok

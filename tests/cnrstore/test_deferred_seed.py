"""A restore returns before the diff base of the restored tables is computed (issue 14):
seed.seed_later computes it from the stored step on a background thread, and the
table's next put waits for it. The base must be exactly what the restore returned, also
when the caller changes the returned tensors at once (training resumes), the handle
closes, or the step's blocks are swept before the put."""

from __future__ import annotations

import threading

import torch

import cnrstore
from cnrstore.core import tablestate
from cnrstore.format.load import load_manifest
from tests.cnrstore.ckpt_util import assert_identical, random_table


def _store(path, **opts):
    return cnrstore.open(path, block_rows=16, fanout=4, seed_from_store=False, **opts)


def _blocked_seeder():
    """Occupy the background seeder until the returned event is set, so that the next
    deferred bases are still pending when the test acts."""
    release, started = threading.Event(), threading.Event()

    def hold(_cancel):
        started.set()
        release.wait(30)
        return None, None, set()

    tablestate.DeferredBase(hold, object())
    started.wait(30)
    return release


def test_training_on_the_restored_tensors_before_seeding_is_seen_as_changes(tmp_path):
    g = torch.Generator().manual_seed(1)
    t, u = random_table(g, 200, 8), random_table(g, 100, 3, dtype=torch.float64)
    with _store(tmp_path / "s") as s:
        s.put_tables(1, {"t": t, "u": u})
    release = _blocked_seeder()
    try:
        with _store(tmp_path / "s") as s:
            got = s.get_tables(1)
            state = s._core.states["t"]
            assert state.deferred is not None and state.fingerprints is None
            got["t"][[5, 77, 199]] += 1  # training resumes in place, before any seeding
            got["u"][0, 0] = float("nan")
            release.set()
            info = s.put_tables(2, got)
            assert info.rows_changed == {"t": 3, "u": 1}
            assert_identical(s.get_tables(2)["t"], got["t"])
            assert_identical(s.get_tables(2)["u"], got["u"])
    finally:
        release.set()


def test_in_place_restore_defers_seeding_too(tmp_path):
    g = torch.Generator().manual_seed(2)
    t = random_table(g, 120, 5)
    with _store(tmp_path / "s") as s:
        s.put_tables(1, {"t": t}, quant={"t": "int8"})
    dest = torch.zeros_like(t)
    with _store(tmp_path / "s") as s:
        s.get_tables(1, out={"t": dest})
        dest[10] += 1
        assert s.put_tables(2, {"t": dest}, quant={"t": "int8"}).rows_changed == {"t": 1}


def test_closing_right_after_a_restore_stops_the_seeder(tmp_path):
    g = torch.Generator().manual_seed(3)
    tables = {f"t{i}": random_table(g, 400, 16) for i in range(4)}
    with _store(tmp_path / "s") as s:
        s.put_tables(1, tables)
    for _ in range(3):
        s = _store(tmp_path / "s")
        s.get_tables(1)
        s.close()  # must not hang, nor leave a thread reading the closed store
        assert not tablestate._RUNNING.get(id(s._core.objects))
    with _store(tmp_path / "s") as s:
        got = s.get_tables(1)
        assert s.put_tables(2, got).rows_changed == {name: 0 for name in tables}


def test_blocks_swept_before_the_put_are_written_full(tmp_path):
    g = torch.Generator().manual_seed(4)
    t = random_table(g, 64, 4)
    with _store(tmp_path / "s") as s:
        s.put_tables(1, {"t": t})
        t2 = t.clone()
        t2[3] += 1
        s.put_tables(2, {"t": t2})
    release = _blocked_seeder()
    try:
        reader = _store(tmp_path / "s")
        got = reader.get_tables(2)
        with _store(tmp_path / "s") as other:  # another handle drops step 2 and sweeps it
            other.delete_step(2)
            other.gc()
        release.set()
        got["t"][40] += 1
        reader.put_tables(3, {"t": got["t"]})
        assert_identical(reader.get_tables(3)["t"], got["t"])
        assert reader.verify().ok
        tm = load_manifest(reader._core.objects, 3).tables["t"]
        assert tm.depth[0] == 0  # block 0's patch chain was swept: written full
        reader.close()
    finally:
        release.set()

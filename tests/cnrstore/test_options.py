"""One options object (issue 9): cnrstore.Options lists the options once; block_rows and
fanout describe the stored data, so the first put stores them and an open reads them back:
left out they are the store's, given and different the open says so (OptionsMismatch).
Stores written before options were stored keep opening."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cnrstore
import engine
from cnrstore.core.options import GROUPED_BLOCK_ROWS, OPTIONS_ROOT, Options, OptionsMismatch


def _put(path, **opts):
    with cnrstore.open(path, **opts) as s:
        s.put_tables(1, {"t": torch.arange(64 * 4, dtype=torch.float32).view(64, 4)})


def test_open_without_options_takes_the_stored_ones(tmp_path):
    _put(tmp_path / "c", block_rows=8, fanout=4)
    with cnrstore.open(tmp_path / "c") as s:
        assert (s.options.block_rows, s.options.fanout) == (8, 4)
        t = s.get_tables(1)["t"]
        t[3] += 1
        info = s.put_tables(2, {"t": t})
        assert info.rewritten_blocks == 0 and info.rows_written == {"t": 1}  # incremental
    with cnrstore.open(tmp_path / "c", block_rows=8, fanout=4, max_chain=3) as s:
        assert s.options.max_chain == 3  # not data-describing: never stored, never checked


@pytest.mark.parametrize("given", [{"block_rows": 16}, {"fanout": 8},
                                   {"options": Options(block_rows=16)}])
def test_conflicting_stored_options_are_refused_clearly(tmp_path, given):
    _put(tmp_path / "c", block_rows=8, fanout=4)
    with pytest.raises(OptionsMismatch, match="written with") as err:
        cnrstore.open(tmp_path / "c", **given)
    assert isinstance(err.value, cnrstore.InvalidInput)
    with cnrstore.open(tmp_path / "c", readonly=True) as s:  # nothing was changed
        assert s.steps() == [1]


def test_the_options_object_and_keywords_agree(tmp_path):
    opts = Options(block_rows=8, fanout=4, max_inflight=3)
    with cnrstore.open(tmp_path / "c", opts, max_chain=2) as s:
        assert s.options == dataclasses.replace(opts, max_chain=2, layout="chains",
                                                decode_threads=s.options.decode_threads)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.block_rows = 3  # type: ignore[misc]
    with pytest.raises(cnrstore.InvalidType, match="unknown store option"):
        cnrstore.open(tmp_path / "c", block_row=8)
    for bad in ({"block_rows": 0}, {"fanout": "4"}, {"max_chain": -1}, {"lock_timeout": -1},
                {"block_rows": 2**32}, {"seed_from_store": 1}):
        with pytest.raises(cnrstore.InvalidInput):
            Options(**bad)


def test_a_store_without_stored_options_keeps_opening(tmp_path):
    """A store written before options were stored has no options root: it opens with the
    given (or default) options, and its next put stores them."""
    _put(tmp_path / "c", block_rows=8, fanout=4)
    with engine.open(tmp_path / "c") as objects, objects.writer() as w:
        w.delete_root(OPTIONS_ROOT)  # as the older code left it
    with cnrstore.open(tmp_path / "c", block_rows=8, fanout=4) as s:
        assert s.objects.root(OPTIONS_ROOT) is None
        assert s.get_tables(1)["t"].shape == (64, 4)
        s.put_tables(2, {"t": torch.zeros(64, 4)})
        assert s.objects.root(OPTIONS_ROOT) is not None
        assert s.verify().ok
    with pytest.raises(OptionsMismatch):
        cnrstore.open(tmp_path / "c", block_rows=16)


def test_a_store_without_stored_options_keeps_its_steps_geometry(tmp_path):
    """Such a store (written when a new store took 4096-row blocks), opened with no
    block_rows, takes its newest step's geometry, not today's default: its next put stays
    incremental instead of writing every table in full."""
    t = torch.randn(10_000, 4, generator=torch.Generator().manual_seed(3))
    with cnrstore.open(tmp_path / "c", block_rows=4096, fanout=4) as s:
        s.put_tables(1, {"t": t})
    with engine.open(tmp_path / "c") as objects, objects.writer() as w:
        w.delete_root(OPTIONS_ROOT)
    with cnrstore.open(tmp_path / "c") as s:
        assert (s.options.block_rows, s.options.fanout) == (4096, 4)
        t[5] += 1
        info = s.put_tables(2, {"t": t})
        assert info.rewritten_blocks == 0 and info.rows_written == {"t": 1}
        assert torch.equal(s.get_tables(2)["t"], t)
    with cnrstore.open(tmp_path / "c") as s:  # the put stored the options it used
        assert s.options.block_rows == 4096
    with cnrstore.open(tmp_path / "e") as s:  # a new store takes the default
        assert s.options.block_rows == 32768


def test_a_new_grouped_store_takes_larger_blocks_and_an_old_one_keeps_its_own(tmp_path):
    """The grouped layout's new stores take GROUPED_BLOCK_ROWS rows a block (its per-block
    objects a step cost less there: docs/design/grouped-layout.md); a grouped store that
    stored 32768 keeps it when reopened without block_rows, and so does a chains store."""
    t = torch.randn(200_000, 2, generator=torch.Generator().manual_seed(5))
    with cnrstore.open(tmp_path / "g", layout="grouped") as s:
        assert s.options.block_rows == GROUPED_BLOCK_ROWS == 131072
        s.put_tables(1, {"t": t})
    with cnrstore.open(tmp_path / "g") as s:
        assert (s.options.block_rows, s.options.layout) == (GROUPED_BLOCK_ROWS, "grouped")
        t[7] += 1
        info = s.put_tables(2, {"t": t})
        assert info.rewritten_blocks == 0 and info.rows_written == {"t": 1}
        assert torch.equal(s.get_tables(2)["t"], t)
    with cnrstore.open(tmp_path / "o", layout="grouped", block_rows=32768) as s:
        s.put_tables(1, {"t": t})
    with cnrstore.open(tmp_path / "o") as s:
        assert (s.options.block_rows, s.options.layout) == (32768, "grouped")
    with cnrstore.open(tmp_path / "c", layout="chains") as s:
        assert s.options.block_rows == 32768
    assert Options(layout="grouped").rows == GROUPED_BLOCK_ROWS
    assert Options().rows == Options(layout="chains").rows == 32768


def test_the_memory_twin_stores_options_too():
    objects = engine.MemoryStore()
    with cnrstore.CheckpointStore(objects, block_rows=8) as s:
        s.put_tables(1, {"t": torch.zeros(16, 2)})
    with cnrstore.CheckpointStore(objects) as s:
        assert s.options.block_rows == 8 and s.options.fanout == 256
    with pytest.raises(OptionsMismatch):
        cnrstore.CheckpointStore(objects, block_rows=4)


def test_gc_keeps_the_options(tmp_path):
    _put(tmp_path / "c", block_rows=8, fanout=4)
    with cnrstore.open(tmp_path / "c") as s:
        s.delete_step(1)
        s.gc()
        assert s.steps() == [] and s.verify().ok
    with cnrstore.open(tmp_path / "c") as s:
        assert s.options.block_rows == 8


def test_a_damaged_options_object_never_stops_a_checkpoint_and_verify_reports_it():
    objects = engine.MemoryStore()
    with objects.writer() as w:  # an options object of the right kind, holding garbage
        w.set_root(OPTIONS_ROOT, w.put(6, b"\xc1not msgpack", meta=True))
    with cnrstore.CheckpointStore(objects, block_rows=8) as s:
        s.put_tables(1, {"t": torch.zeros(16, 2)})
        assert s.get_tables(1)["t"].shape == (16, 2)
        report = s.verify()
        assert not report.ok
        assert [p.what for p in report.records] == ["bad-options"]


RACE = """
import sys, torch, cnrstore
try:
    with cnrstore.open(sys.argv[1], block_rows=8, fanout=4, lock_timeout=60) as s:
        s.put_tables(1, {"t": torch.full((32, 4), float(sys.argv[2]))})
    print("put")
except cnrstore.StepExists:
    print("exists")
"""


def test_two_processes_racing_the_first_put_store_the_options_once(tmp_path):
    """Both first puts write the options in their step's transaction: the loser of the
    step race fails with StepExists only, and the store holds the winner's step."""
    import subprocess
    import sys

    path = str(tmp_path / "c")
    with cnrstore.open(path, block_rows=8, fanout=4):
        pass  # create it, holding no step and no options
    procs = [subprocess.Popen([sys.executable, "-c", RACE, path, str(v)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for v in (1, 2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert sorted(o.strip() for o, _ in outs) == ["exists", "put"]
    with cnrstore.open(path) as s:
        assert (s.options.block_rows, s.options.fanout) == (8, 4)
        assert s.steps() == [1] and s.verify().ok

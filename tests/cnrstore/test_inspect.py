"""cnrstore.tools.info, .diff and .transfer against real stores made through the public
API (pack stores in tmp_path; the memory twin where only logic is checked)."""

from __future__ import annotations

import pathlib
import sys
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cnrstore
import engine
from cnrstore.format.load import load_step, load_table_manifest
from cnrstore.format.manifest import KIND_BLOCK_FULL
from cnrstore.tools import diff as cdiff
from cnrstore.tools import info as ci
from cnrstore.tools import transfer

BR = 16  # block_rows: small, so a few hundred rows make many blocks and segments
FANOUT = 4


def _open(path, **opts):
    return cnrstore.open(path, block_rows=BR, fanout=FANOUT, **opts)


@pytest.fixture
def three_steps(tmp_path):
    """Steps 0, 1, 2: rows 5 and 100-104 of "user" change at 1; at 2 "user" grows by 20
    rows and row 3 changes, "item" is dropped and "ids" (int64) appears."""
    gen = torch.Generator().manual_seed(1)
    user = torch.randn(300, 8, generator=gen)
    item = torch.randn(70, 4, generator=gen).half()
    path = tmp_path / "store"
    with _open(path) as s:
        s.put_tables(0, {"user": user, "item": item}, metadata={"lr": 0.1})
        user[5] += 1
        user[100:105] -= 1   # a third of block 6: a patch under any block's budget
        s.put_tables(1, {"user": user, "item": item}, quant={"item": "int8"})
        user2 = torch.cat([user, torch.randn(20, 8, generator=gen)])
        user2[3] = 0
        s.put_tables(2, {"user": user2, "ids": torch.arange(10)})
    return path


def test_list_steps_sizes_add_up(three_steps):
    steps = ci.list_steps(three_steps)
    assert [s.step for s in steps] == [0, 1, 2]
    assert [s.tables for s in steps] == [2, 2, 2]
    assert steps[0].logical_bytes == 300 * 8 * 4 + 70 * 4 * 2
    assert steps[2].logical_bytes == 320 * 8 * 4 + 10 * 8
    assert steps[0].new_bytes == steps[0].stored_bytes
    # Step 1 patched 6 rows of "user": it reaches about as much as step 0 but adds little.
    assert steps[1].new_bytes < steps[1].stored_bytes / 3
    usage = ci.disk_usage(three_steps)
    assert usage.stored_bytes == sum(s.new_bytes for s in steps)


def test_show_step_reports_geometry_chains_and_metadata(three_steps):
    d0 = ci.show_step(three_steps, 0)
    assert d0.metadata == {"lr": 0.1}
    d1 = ci.show_step(three_steps, 1)
    user = {t.name: t for t in d1.tables}["user"]
    assert (user.shape, user.dtype, user.scheme, user.block_rows) == ((300, 8), "float32",
                                                                      "exact", BR)
    assert user.blocks == -(-300 // BR)
    assert user.full_blocks + user.patched_blocks == user.blocks
    assert user.patched_blocks == 2 and user.max_depth == 1  # rows 5 and 100-104: 2 blocks
    assert user.rows_changed == 6
    item = {t.name: t for t in d1.tables}["item"]
    assert item.scheme == "int8" and item.patched_blocks == 0  # re-encoded: all full
    with pytest.raises(cnrstore.StepNotFound):
        ci.show_step(three_steps, 9)


def test_diff_finds_tables_blocks_and_rows(three_steps):
    d = ci.diff_steps(three_steps, 0, 1)
    t = {x.name: x for x in d.tables}
    assert not d.identical and d.metadata_changed
    assert t["user"].status == "changed" and t["user"].blocks_changed == (0, 6)
    assert t["user"].row_ranges == ((5, 6), (100, 105)) and t["user"].rows_changed == 6
    assert t["user"].patches_read == 2 and t["user"].blocks_decoded == 0
    assert t["item"].encoding_changed and t["item"].rows_changed is None

    d = ci.diff_steps(three_steps, 1, 2)
    t = {x.name: x for x in d.tables}
    assert t["item"].status == "removed" and t["ids"].status == "added"
    assert t["user"].rows_added == 20 and t["user"].row_ranges == ((3, 4),)

    same = ci.diff_steps(three_steps, 2, 2)
    assert same.identical and all(x.status == "unchanged" for x in same.tables)


class _Reads:
    """A real pack store that records which ids were read with ``get``."""

    def __init__(self, objects):
        self._objects = objects
        self.read: set[bytes] = set()

    def get(self, oid):
        self.read.add(bytes(oid))
        return self._objects.get(oid)

    def __getattr__(self, name):
        return getattr(self._objects, name)


def test_diff_never_reads_unchanged_blocks(three_steps):
    with engine.open(three_steps, create=False) as objects:
        reads = _Reads(objects)
        d = cdiff.diff_steps(reads, 0, 1)
        changed = {x.name: set(x.blocks_changed) for x in d.tables}
        for step in (0, 1):
            _, node = load_step(objects, step)
            for toid in node.table_ids:
                tm = load_table_manifest(objects, toid)
                for i, bid in enumerate(tm.block_ids):
                    if i not in changed[tm.node.name]:
                        assert bid not in reads.read, (step, tm.node.name, i)
        # Only the two patches of step 1 were read, not the full blocks under them.
        data = [o for o in reads.read if objects.info(o).kind == KIND_BLOCK_FULL]
        assert data == []


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.sets(st.integers(0, 199), max_size=30),
    second=st.sets(st.integers(0, 199), max_size=30),
    fresh_handle=st.booleans(),
)
def test_diff_rows_match_the_tables(first, second, fresh_handle):
    """Whatever rows change, by patch chains or (fresh handle, no diff base) by full blocks,
    diff's rows are exactly the rows whose values differ, in both directions."""
    gen = torch.Generator().manual_seed(len(first) * 7 + len(second))
    t0 = torch.randn(200, 3, generator=gen)
    t1 = t0.clone()
    t1[sorted(first)] += 1
    t2 = t1.clone()
    t2[sorted(second)] -= 3
    with tempfile.TemporaryDirectory() as tmp:
        with _open(tmp) as s:
            s.put_tables(0, {"t": t0})
            s.put_tables(1, {"t": t1})
        with _open(tmp, seed_from_store=not fresh_handle) as s:
            s.put_tables(2, {"t": t2})
        for a, b, ta, tb in ((0, 2, t0, t2), (2, 0, t2, t0), (1, 2, t1, t2)):
            want = torch.nonzero((ta != tb).any(dim=1)).flatten().tolist()
            (td,) = ci.diff_steps(tmp, a, b).tables
            got = [r for lo, hi in td.row_ranges for r in range(lo, hi)]
            assert got == want, (a, b)
            assert td.rows_changed == len(want)
            assert (td.status == "unchanged") == (not want)


@settings(max_examples=40, deadline=None)
@given(st.sets(st.integers(0, 5000), max_size=200))
def test_row_ranges_cover_exactly_the_rows(rows):
    want = sorted(rows)
    ranges = cdiff._ranges(np.array(want, dtype=np.int64))
    assert [r for lo, hi in ranges for r in range(lo, hi)] == want
    # maximal runs: each range is non-empty and a gap separates it from the next
    assert all(lo < hi for lo, hi in ranges)
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))


def test_gc_plan_predicts_what_gc_frees(three_steps):
    plan = ci.gc_plan(three_steps, keep_last=1, keep=[0])
    assert plan.keep == (0, 2) and plan.drop == (1,)
    with _open(three_steps) as s:
        assert s.steps() == [0, 1, 2]  # the plan changed nothing
        report = ci.collect(s, keep_last=1, keep=[0])
        assert report.steps_deleted == plan.drop
        assert report.objects_freed == plan.objects_freed + plan.garbage_objects
        assert s.steps() == [0, 2]
    with pytest.raises(cnrstore.InvalidInput):
        ci.gc_plan(three_steps, keep_last=1, keep=[5])


def test_kept_steps_rules():
    assert ci.kept_steps([1, 2, 3], keep_last=None) == [1, 2, 3]
    assert ci.kept_steps([1, 2, 3], keep_last=None, keep=[1]) == [1]
    assert ci.kept_steps([1, 2, 3], keep_last=2) == [2, 3]
    assert ci.kept_steps([1, 2, 3], keep_last=5, keep=[1]) == [1, 2, 3]
    with pytest.raises(cnrstore.InvalidInput):
        ci.kept_steps([1, 2, 3], keep_last=1, keep=[4])


def _largest_pack(path: pathlib.Path) -> pathlib.Path:
    return max(path.glob("packs/*/*.pack"), key=lambda p: p.stat().st_size)


def test_verify_finds_a_flipped_byte_and_scopes_by_step(three_steps):
    clean = ci.verify(three_steps, deep=True)
    assert clean.ok and clean.steps_checked == 3 and clean.blocks_decoded > 0
    pack = _largest_pack(three_steps)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    bad = ci.verify(three_steps, deep=True)
    assert not bad.ok and bad.problems
    assert all(p.message for p in bad.problems)
    with pytest.raises(cnrstore.StepNotFound):
        ci.verify(three_steps, steps=[42])


def test_inspect_accepts_a_store_handle_over_the_memory_twin():
    with cnrstore.CheckpointStore(engine.MemoryStore(), block_rows=BR, fanout=FANOUT) as s:
        s.put_tables(3, {"a": torch.ones(40, 2)})
        assert [x.step for x in ci.list_steps(s)] == [3]
        assert ci.show_step(s, 3).tables[0].blocks == 3
        assert ci.disk_usage(s).tables[0].name == "a"
    with pytest.raises(TypeError):
        ci.list_steps(object())


def test_export_import_round_trip(three_steps, tmp_path):
    out = tmp_path / "s1.safetensors"
    with _open(three_steps) as s:
        res = transfer.export_step(s, 1, out)
        assert res.tables == ("user", "item") and res.schemes == {"user": "exact",
                                                                  "item": "int8"}
        want = s.get_tables(1)
        with pytest.raises(cnrstore.BadPath, match="exists"):
            transfer.export_step(s, 1, out)
        with pytest.raises(cnrstore.BadPath, match="directory"):
            transfer.export_step(s, 1, tmp_path)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        imp = transfer.import_step(s, 5, out)
        assert imp.schemes == {"user": "exact", "item": "int8"}
        got = s.get_tables(5)
        assert torch.equal(got["user"], want["user"])  # exact: bit-identical
        assert got["item"].dtype == torch.float16 and got["item"].shape == (70, 4)
        assert ci.show_step(s, 5).metadata == ci.show_step(s, 1).metadata
        with pytest.raises(cnrstore.StepExists):
            transfer.import_step(s, 5, out)
        junk = tmp_path / "junk.safetensors"
        junk.write_bytes(b"not a safetensors file")
        with pytest.raises(cnrstore.InvalidInput):
            transfer.import_step(s, 6, junk)
        assert s.steps() == [0, 1, 2, 5]
    with pytest.raises(cnrstore.InvalidType, match="CheckpointStore"):
        transfer.export_step(str(three_steps), 1, tmp_path / "y.safetensors")


def test_transfer_without_safetensors_says_what_to_install(three_steps, tmp_path,
                                                          monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert transfer.MissingExtra is cnrstore.MissingExtra
    with _open(three_steps) as s, pytest.raises(cnrstore.MissingExtra, match="pip install"):
        transfer.export_step(s, 1, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()

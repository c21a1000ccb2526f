"""Incremental puts: what gets written, patch chains, diff-base seeding (docs/MANIFEST.md)."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import assert_identical, make_store, random_table

import cnrstore
from cnrstore.codec.quantize import row_nbytes
from cnrstore.core.chainpolicy import block_key, chain_budget, depth_cap
from cnrstore.format.load import load_manifest
from cnrstore.format.manifest import changed_blocks


def _scattered(g, t, frac):
    idx = torch.randperm(t.shape[0], generator=g)[: int(t.shape[0] * frac)]
    t[idx] += 1.0
    return idx


def test_scattered_update_writes_close_to_the_changed_rows(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = random_table(g, 20000, 32)
    with cnrstore.open(tmp_path / "s", block_rows=256) as s:
        full = s.put_tables(1, {"t": t})
        idx = _scattered(g, t, 0.05)
        info = s.put_tables(2, {"t": t})
        changed = len(idx) * row_nbytes("exact", torch.float32, 32)
        assert info.rows_changed == {"t": len(idx)}
        # Patches carry a 2-byte index per row plus headers and manifest nodes.
        assert info.bytes_new <= 1.1 * changed
        assert info.bytes_written <= 1.1 * changed
        assert info.bytes_written < full.bytes_written / 10
        assert_identical(s.get_tables(2)["t"], t)
        assert_identical(s.get_tables(1)["t"][:5], s.get_tables(1, rows={"t": slice(0, 5)})["t"])


def test_unchanged_put_writes_only_the_step_node():
    g = torch.Generator().manual_seed(1)
    s = make_store("memory", None, block_rows=16, fanout=4)
    t = {"a": random_table(g, 200, 4), "b": random_table(g, 50, dtype=torch.int16)}
    s.put_tables(1, t)
    info = s.put_tables(2, t)
    assert info.objects_new == 1 and info.rows_changed == {"a": 0, "b": 0}
    m1, m2 = (load_manifest(s.objects, k) for k in (1, 2))
    assert m1.node.table_ids == m2.node.table_ids  # tables shared by id


def test_patch_chains_are_bounded_and_merged_onto_the_full_block():
    """Table t's block 0 has a depth cap of 2 with max_chain=3 (chainpolicy.depth_cap): at
    the cap the
    chain is replaced by one merged patch on the full block (the one row that differs
    from it), never by a rewrite of the whole block."""
    assert depth_cap(block_key("t", 0), 3) == 2
    g = torch.Generator().manual_seed(2)
    s = make_store("memory", None, block_rows=32, fanout=2, max_chain=3)
    t = random_table(g, 200, 8)
    s.put_tables(0, {"t": t})
    full = load_manifest(s.objects, 0).tables["t"].block_ids[0]
    depths = []
    for step in range(1, 9):
        t[5] += 1.0  # one row of block 0, again and again
        s.put_tables(step, {"t": t})
        tm = load_manifest(s.objects, step).tables["t"]
        depths.append(tm.depth[0])
        assert all(d == 0 for d in tm.depth[1:])
        assert tm.chain_bytes[0] <= 32 * 8 * 4 // 2
        prev = load_manifest(s.objects, step - 1).tables["t"]
        assert changed_blocks(prev, tm) == [0]
        if tm.depth[0] == 1:  # the first patch, or a merged one: its base is the full block
            assert s.objects.get(tm.block_ids[0]).refs == (full,)
    assert depths == [1, 2, 1, 2, 1, 2, 1, 2]
    for step in range(9):
        got = s.get_tables(step)["t"]
        assert float(got[5, 0] - got[6, 0]) != 0.0
    assert_identical(s.get_tables(8)["t"], t)


def test_patch_bytes_bounded_by_the_blocks_budget():
    """Table t's block 0 may hold 682 patch bytes of its 1024, block 1 998 of them
    (chainpolicy.chain_budget): a 20-row patch (700 bytes) fits block 1's, not block 0's;
    a second one outgrows block 1's, and the merged patch (the same 20 rows, 700 bytes)
    is over half its budget, so block 1 is written full too."""
    assert [chain_budget(block_key("t", i), 32, 32) for i in (0, 1)] == [682, 998]
    g = torch.Generator().manual_seed(3)
    s = make_store("memory", None, block_rows=32, fanout=4)
    t = random_table(g, 64, 8)
    s.put_tables(0, {"t": t})
    t[0:20] += 1.0
    t[32:52] += 1.0
    info = s.put_tables(1, {"t": t})
    assert load_manifest(s.objects, 1).tables["t"].depth[:2] == [0, 1]
    assert info.rows_changed == {"t": 40} and info.rows_written == {"t": 52}  # block 0 full
    t[32:52] += 1.0
    info = s.put_tables(2, {"t": t})
    assert load_manifest(s.objects, 2).tables["t"].depth[:2] == [0, 0]
    assert info.rows_changed == {"t": 20} and info.rows_written == {"t": 32}  # block 1 full
    assert_identical(s.get_tables(2)["t"], t)


def test_growth_keeps_old_blocks_and_shrink_works():
    g = torch.Generator().manual_seed(4)
    s = make_store("memory", None, block_rows=16, fanout=4)
    t = random_table(g, 100, 4)
    s.put_tables(0, {"t": t})
    grown = torch.cat([t, random_table(g, 50, 4)])
    info = s.put_tables(1, {"t": grown})
    assert info.rows_changed == {"t": 50}
    # Old last block (rows 96..99, now 96..111) is rewritten full, later blocks are new.
    assert info.bytes_new < (16 + 50) * 16 + 2000
    shrunk = grown[:40].clone()
    s.put_tables(2, {"t": shrunk})
    for step, want in ((0, t), (1, grown), (2, shrunk)):
        assert_identical(s.get_tables(step)["t"], want)
    m0, m1 = (load_manifest(s.objects, k).tables["t"] for k in (0, 1))
    assert m0.block_ids[:6] == m1.block_ids[:6]


@pytest.mark.parametrize("change", ["dtype", "scheme", "width"])
def test_changed_encoding_rewrites_the_table(change):
    g = torch.Generator().manual_seed(5)
    s = make_store("memory", None, block_rows=16)
    t = random_table(g, 64, 4)
    s.put_tables(0, {"t": t})
    new, quant = t, "exact"
    if change == "dtype":
        new = t.double()
    elif change == "scheme":
        quant = "fp16"
    else:
        new = torch.cat([t, t], dim=1)
    info = s.put_tables(1, {"t": new}, quant=quant)
    assert info.rows_changed == {"t": 64}
    got = s.get_tables(1)["t"]
    assert got.dtype == new.dtype and got.shape == new.shape
    assert_identical(s.get_tables(0)["t"], t)


def test_fresh_handle_first_put_does_not_double_storage(tmp_path):
    g = torch.Generator().manual_seed(6)
    t = random_table(g, 8192, 16)
    with cnrstore.open(tmp_path / "s", block_rows=512) as s:
        s.put_tables(1, {"t": t})
        _scattered(g, t, 0.02)  # every block gets a patch
        s.put_tables(2, {"t": t})
        base = s.stats().stored_bytes
    for seed in (True, False):
        t[7] += 1.0
        with cnrstore.open(tmp_path / "s", block_rows=512, seed_from_store=seed) as s:
            step = 10 if seed else 11
            info = s.put_tables(step, {"t": t})
            if seed:  # diffed against step 2's stored codes: one row changed
                assert info.rows_changed == {"t": 1}
                assert info.bytes_written < 4096
            else:  # no diff base: full blocks, deduplicated by content where possible
                assert info.rows_changed == {"t": 8192}
            assert_identical(s.get_tables(step)["t"], t)
    with cnrstore.open(tmp_path / "s", block_rows=512, seed_from_store=False) as s:
        info = s.put_tables(12, {"t": t})  # same as step 11: every full block dedups
        assert info.objects_new == 1
        assert s.stats().stored_bytes < 2.2 * base


def test_restore_seeds_the_diff_base_of_unput_tables_only():
    g = torch.Generator().manual_seed(7)
    s0 = make_store("memory", None, block_rows=16, seed_from_store=False)
    a, b = random_table(g, 100, 4), random_table(g, 100, 4)
    s0.put_tables(1, {"a": a, "b": b})
    a2, b2 = a.clone(), b.clone()
    a2[3] += 1
    b2[4] += 1
    s0.put_tables(2, {"a": a2, "b": b2})
    # A second handle on the same engine store, as a restarted job would open.
    s = cnrstore.CheckpointStore(s0.objects, block_rows=16, seed_from_store=False)
    s.get_tables(1, names=["a"], rows={"a": slice(0, 10)})  # partial: seeds nothing
    assert s.put_tables(3, {"a": a2}).rows_changed == {"a": 100}
    restored = s.get_tables(2)  # seeds b (never put here) but not a (put by this handle)
    a3 = restored["a"].clone()
    a3[50] += 1
    b3 = restored["b"].clone()
    b3[60] += 1
    info = s.put_tables(4, {"a": a3, "b": b3})
    # a diffs against this handle's own put (step 3 = a2), b against the restore of step 2.
    assert info.rows_changed == {"a": 1, "b": 1}
    s.get_tables(1)  # an older step: must not replace either diff base
    assert s.put_tables(5, {"a": a3, "b": b3}).rows_changed == {"a": 0, "b": 0}


def test_lossy_seeding_compares_codes():
    g = torch.Generator().manual_seed(8)
    s0 = make_store("memory", None, block_rows=16, seed_from_store=False)
    t = random_table(g, 100, 8)
    s0.put_tables(1, {"t": t}, quant="int8")
    s = cnrstore.CheckpointStore(s0.objects, block_rows=16, seed_from_store=False)
    s.get_tables(1)
    t2 = t.clone()
    t2[10] += 1
    assert s.put_tables(2, {"t": t2}, quant="int8").rows_changed == {"t": 1}
    fresh = cnrstore.CheckpointStore(s0.objects, block_rows=16)  # seeds from step 2
    assert fresh.put_tables(3, {"t": t2}, quant="int8").rows_changed == {"t": 0}


def test_gc_of_the_diff_base_step_forces_full_blocks():
    g = torch.Generator().manual_seed(9)
    s = make_store("memory", None, block_rows=16, fanout=2)
    t = random_table(g, 64, 4)
    s.put_tables(1, {"t": t})
    t[3] += 1
    s.put_tables(2, {"t": t})  # patch on block 0
    s.delete_step(2)
    s.gc()
    t[40] += 1
    info = s.put_tables(3, {"t": t})
    assert_identical(s.get_tables(3)["t"], t)
    tm = load_manifest(s.objects, 3).tables["t"]
    assert tm.depth[0] == 0  # the patched block was gone: rewritten full
    assert s.verify().ok
    assert info.rows_changed == {"t": 1}  # still diffed against the handle's last put


def test_touched_rows_skip_fingerprinting_the_rest():
    g = torch.Generator().manual_seed(10)
    s = make_store("memory", None, block_rows=16)
    t = random_table(g, 100, 4)
    s.put_tables(1, {"t": t})
    t[[5, 70]] += 1
    info = s.put_tables(2, {"t": t}, touched={"t": [5, 70, 71]})
    # row 71 was touched but holds what it held: its fingerprint says so, it is not written
    assert info.rows_changed == {"t": 2}
    assert info.rows_written == {"t": 2}
    assert_identical(s.get_tables(2)["t"], t)
    t[90] += 1  # not reported: by contract the caller says it is unchanged
    s.put_tables(3, {"t": t}, touched={"t": torch.tensor([], dtype=torch.int64)})
    assert not torch.equal(s.get_tables(3)["t"][90], t[90])
    t[95] += 1  # a put without touched= fingerprints every row again
    assert s.put_tables(4, {"t": t}).rows_changed == {"t": 2}


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["exact", "int8"])
def test_scattered_update_at_default_block_size(tmp_path, quant):
    g = torch.Generator().manual_seed(11)
    t = random_table(g, 200_000, 64)
    with cnrstore.open(tmp_path / "s") as s:  # block_rows 32768, fanout 256
        full = s.put_tables(1, {"t": t}, quant=quant)
        idx = _scattered(g, t, 0.05)
        info = s.put_tables(2, {"t": t}, quant=quant)
        changed = len(idx) * row_nbytes(quant, torch.float32, 64)
        assert info.rows_changed == {"t": len(idx)}
        assert info.bytes_written <= 1.15 * changed
        assert info.bytes_written < full.bytes_written / 10

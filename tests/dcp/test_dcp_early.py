"""The first blocks of a DCP load, hinted when the rank's plan is known (cnrstore/dcp/
early.py): where the metadata read says every block's records lie, and which of them a
rank's rows hint first."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cnrstore
from cnrstore.dcp import StorageReader, StorageWriter, close_stores, early
from cnrstore.format.load import load_step, load_table_manifest
from engine import RecordLocation

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _saved(path) -> dict:
    g = torch.Generator().manual_seed(0)
    s = {"emb": torch.randn(1000, 8, generator=g), "acc": torch.rand(300, generator=g)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(s, storage_writer=StorageWriter(path, step=1, block_rows=64))
        s["emb"][:3] += 1.0  # step 2: patches over step 1's blocks
        dcp.save(s, storage_writer=StorageWriter(path, step=2, block_rows=64))
    close_stores()
    return s


def test_the_locations_are_each_blocks_whole_chain(tmp_path):
    path = str(tmp_path / "ckpt")
    _saved(path)
    with cnrstore.open(path) as store:
        locs = early.locations(store.objects, 2, ["emb", "acc", "no such table"])
        assert locs is not None and sorted(locs) == ["acc", "emb"]
        _, node = load_step(store.objects, 2)
        for name, tid in zip(node.tables, node.table_ids):
            tm = load_table_manifest(store.objects, tid)
            block_rows, chains = locs[name]
            assert block_rows == tm.node.block_rows and len(chains) == len(tm.block_ids)
            for oid, chain in zip(tm.block_ids, chains):
                want = store.objects.locate_closure([oid])
                got = {RecordLocation.from_wire(w).oid: RecordLocation.from_wire(w)
                       for w in chain}
                assert got == want
        # step 2 changed rows of emb's first block: a patch on step 1's block
        assert len(locs["emb"][1][0]) == 2 and len(locs["emb"][1][-1]) == 1


def test_a_rank_hints_the_blocks_of_its_rows_in_order_up_to_the_budget(tmp_path):
    path = str(tmp_path / "ckpt")
    _saved(path)
    with cnrstore.open(path) as store:
        locs = early.locations(store.objects, 2, ["emb", "acc"])
    assert locs is not None
    emb, acc = locs["emb"][1], locs["acc"][1]

    def size(chains):
        return sum(RecordLocation.from_wire(w).length for c in chains for w in c)

    # rows 100..300 of emb: blocks 1..4; then acc's rows 0..10: block 0; emb again: once
    spans = [("emb", 100, 300), ("gone", 0, 10), ("acc", 0, 10), ("emb", 130, 140)]
    assert early.plan(locs, spans, budget=1 << 30) == [*emb[1:5], acc[0]]
    # the budget stops before the block that would go past it (the first always goes)
    assert early.plan(locs, spans, budget=size(emb[1:3])) == emb[1:3]
    assert early.plan(locs, spans, budget=1) == emb[1:2]
    assert early.plan(locs, [("emb", 5, 5)]) == []


def test_a_load_with_hints_of_a_closed_store_reads_the_same(tmp_path):
    path = str(tmp_path / "ckpt")
    s = _saved(path)
    r = StorageReader(path, step=2)
    target = {"emb": torch.zeros(1000, 8), "acc": torch.zeros(300)}
    dcp.load(target, storage_reader=r)
    assert all(torch.equal(target[k], s[k]) for k in s)
    with cnrstore.open(path) as store:
        locs = early.locations(store.objects, 2, ["emb"])
        objects = store.objects
    assert locs is not None
    t = early.hint(objects, early.plan(locs, [("emb", 0, 1000)]))  # closed: hints nothing
    assert t is not None
    t.join(10)
    assert not t.is_alive()


def test_the_coordinator_hints_each_ranks_first_blocks_of_an_even_cut_in_turn(tmp_path):
    path = str(tmp_path / "ckpt")
    _saved(path)
    with cnrstore.open(path) as store:
        locs = early.locations(store.objects, 2, ["emb", "acc"])
    assert locs is not None
    emb, acc = locs["emb"][1], locs["acc"][1]  # 16 and 5 blocks of 64 rows
    # two ranks: emb's blocks 0..7 and 8..15, acc's 0..2 and 3..4, a block of each in turn
    want = [c for pair in zip(emb[:8], emb[8:]) for c in pair] + [acc[0], acc[3], acc[1],
                                                                  acc[4], acc[2]]
    assert early.even_split(locs, 2, budget=1 << 30) == want
    assert early.even_split(locs, 1, budget=1 << 30) == [*emb, *acc]
    # the budget is each rank's: one block each
    assert early.even_split(locs, 2, budget=1) == [emb[0], emb[8]]
    # more ranks than blocks: a block is hinted once
    assert early.even_split({"acc": locs["acc"]}, 8, budget=1 << 30) == acc


def test_the_patches_hinted_are_every_record_of_a_chain_but_its_full_block(tmp_path):
    path = str(tmp_path / "ckpt")
    s = _saved(path)
    with cnrstore.open(path) as store:
        locs = early.locations(store.objects, 2, ["emb", "acc"])
    assert locs is not None
    emb = locs["emb"][1]
    # step 2 changed rows 0..3 of emb: block 0 is a patch over step 1's full block
    assert len(emb[0]) == 2 and all(len(c) == 1 for c in emb[1:])
    sizes = [RecordLocation.from_wire(w).length for w in emb[0]]
    patch = emb[0][sizes.index(min(sizes))]
    assert early.patches(locs) == [patch]
    assert early.patches(locs, [("emb", 0, 10), ("emb", 5, 64), ("gone", 0, 5)]) == [patch]
    assert early.patches(locs, [("emb", 64, 1000), ("acc", 0, 300)]) == []
    assert early.patches(locs, [("emb", 0, 10)], budget=0) == []
    # a load that hints them reads the same
    r = StorageReader(path, step=2)
    target = {"emb": torch.zeros(1000, 8), "acc": torch.zeros(300)}
    dcp.load(target, storage_reader=r)
    close_stores()
    assert all(torch.equal(target[k], s[k]) for k in s)

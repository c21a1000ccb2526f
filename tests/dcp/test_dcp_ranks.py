"""DCP's save, async_save and load through cnrstore on spawned gloo ranks (modeled on
torch's test/distributed/checkpoint/: reshard on load under another world size and shard
plan, sharded <-> plain, bytes items, a faulty storage layer and planner). Few tests, each
a whole program per spawn: every spawn costs seconds of torch imports on 2 cores."""

from __future__ import annotations

import warnings

import dcp_workers as W
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_util import Failed, run

import cnrstore
from cnrstore.dcp import StorageReader, StorageWriter


def _ok(results: list) -> list:
    for r in results:
        assert not isinstance(r, Failed), r.trace
    return results


def _plain_put_ids(path, steps: list[int]) -> list[dict]:
    """Table ids of a one-process put_tables of the tensors W.save gives DCP."""
    out = []
    with cnrstore.open(path, block_rows=32) as store:
        for step in steps:
            t = W.full(step)
            out.append(store.put_tables(step, {
                "model.emb": t["emb"], "model.bias": t["bias"], "optim.acc": t["acc"],
                "optim.step": torch.tensor([step])}).tables)
    return out


def test_saved_at_two_ranks_loads_at_three_and_in_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = _ok(run(2, W.save, path, "dtensor", [1, 2]))
    # The ranks agree, and the blocks are those put_tables writes for the same tensors.
    assert saved[0] == saved[1]
    ids = _plain_put_ids(str(tmp_path / "plain"), [1, 2])
    assert [s[2] for s in saved[0]] == ids
    # No group at all: plain tensors in this process (DCP's no_dist), loaded and saved.
    target = W.zeroed(W.state("plain", 1, 0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=StorageReader(path, step=1), no_dist=True)
        W.check(target, 1)
        dcp.save(W.state("plain", 3, 0, 1), storage_writer=StorageWriter(path, step=3),
                 no_dist=True)
    # Another world size and other kinds of sharding: the DTensors' step as ShardedTensor
    # rows, the plain tensors' step as DTensors.
    assert _ok(run(3, W.loads, path, [("sharded", 2), ("dtensor", 3)])) == [True] * 3


def test_async_executors_and_an_open_group_store(tmp_path):
    path = str(tmp_path / "ckpt")
    res = _ok(run(2, W.executors, path, timeout=240))
    assert res[0] == res[1]
    (first, changed_first), (later, changed), steps, col_ok, col_saved_ok = res[0]
    assert steps == [1, 2, 3, 4]
    assert changed["model.emb"] == 3 and changed["optim.acc"] == 0
    # A later save writes the changed rows (and the step's nodes: most of it, at this
    # size; benches/bench_dcp.py measures the ratio at a realistic one).
    assert later <= 0.2 * first, (later, first)
    assert col_ok and col_saved_ok


def test_failures_reach_every_rank_and_leave_the_store(tmp_path):
    path = str(tmp_path / "ckpt")
    res = _ok(run(2, W.failures, path, timeout=180))
    for rank_out in res:
        *cases, (steps, ok) = rank_out
        assert steps == [1] and ok
        got = {name: (failed, text) for name, failed, text in cases}
        assert got["prepare_local_plan"][0] == [1], got["prepare_local_plan"]
        assert got["write_data"][0] == [0, 1] and "faulty resolve_data" in got["write_data"][1]
        # column chunks are joined into rows (test_executors...); a cut past them is not
        assert got["past the columns"][0] == [0, 1] and "'cube'" in got["past the columns"][1]
        assert got["past the columns"][1].count("sharded along a dim past the columns") == 2
        assert "StepExists" in got["step exists"][1]
        assert got["disk full"][0] == [0, 1] and "No space left" in got["disk full"][1]
        assert got["missing step"][0] == [0, 1] and "step 5" in got["missing step"][1]
        assert got["shape"][0] == [0, 1] and "Size mismatch" in got["shape"][1]


@pytest.mark.slow
def test_four_ranks_save_and_load_at_one_and_two(tmp_path):
    path = str(tmp_path / "ckpt")
    _ok(run(4, W.save, path, "sharded", [1], timeout=240))
    assert _ok(run(2, W.load, path, "dtensor", 1, 1)) == [True] * 2
    assert _ok(run(1, W.load, path, "dtensor", 1, 1)) == [True]


def test_a_path_keeps_its_store_on_every_rank_until_another_handle_changes_it(tmp_path):
    res = _ok(run(2, W.kept_store, str(tmp_path / "ckpt")))
    for (a, _), (b, ch2), (c, ch3), same, left in res:
        assert a == b != c            # kept for step 2, opened afresh for step 3
        assert ch2["model.emb"] == 3 and ch2["optim.acc"] == 0
        assert ch3["model.emb"] == 3  # step 1 + 2 bumps: the same 3 rows
        assert same and left == 0


def test_a_load_reads_every_kind_of_piece_in_one_collective_read(tmp_path):
    # Rows decoded in place, columns (and the 0-d step counter) copied: three rounds of
    # the store's group (the read's request, its answer, its closing round); a plan round
    # of its own and a read per kind of piece made it seven (seen before the change).
    assert _ok(run(2, W.load_rounds, str(tmp_path / "ckpt"))) == [[3, 3]] * 2


def test_a_path_load_reads_the_document_in_the_opens_own_round(tmp_path):
    # The open's two rounds bring the step's document (and the latest step, for
    # step=None), then the kept store's reuse check (two) and the read (three): 7. The
    # metadata's own rounds made it 9, and 11 with step=None (seen before the change).
    res = _ok(run(2, W.path_load_rounds, str(tmp_path / "ckpt")))
    for got in res:
        assert got[:2] == [7, 7]
        assert "rank 0: step 9 not found" in got[2]  # the coordinator's, on every rank

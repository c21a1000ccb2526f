"""The public API (docs/GUIDE.md, "The API contract"), against the memory twin and the real
pack store."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future

import pytest
import torch
from ckpt_util import assert_identical, make_store, random_table

import cnrstore
import engine


@pytest.fixture(params=["memory", "pack"])
def store(request, tmp_path):
    s = make_store(request.param, tmp_path / "ckpt", block_rows=16, fanout=4)
    yield s
    s.close()


def _tables(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "user": random_table(g, 100, 8),
        "item": random_table(g, 37, 3, 2, dtype=torch.float16),
        "ids": random_table(g, 20, dtype=torch.int64),
    }


def test_public_names_are_exported_with_docstrings():
    for name in cnrstore.__all__:
        obj = getattr(cnrstore, name)
        assert obj.__doc__, name
    assert callable(cnrstore.open)


def test_put_get_roundtrip_and_stepinfo(store):
    tables = _tables()
    info = store.put_tables(100, tables, metadata={"lr": 0.1})
    assert isinstance(info, cnrstore.StepInfo)
    assert dataclasses.is_dataclass(info)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.step = 3
    assert info.step == 100
    assert len(bytes.fromhex(info.root)) == 16
    assert info.logical_bytes == sum(t.numel() * t.element_size() for t in tables.values())
    assert info.rows_changed == {"user": 100, "item": 37, "ids": 20}
    assert info.objects_new > 0 and info.bytes_written > 0
    got = store.get_tables(100)
    assert list(got) == ["user", "item", "ids"]
    for name, t in tables.items():
        assert_identical(got[name], t)


def test_latest_step_is_the_highest_number(store):
    a, b = _tables(1), _tables(2)
    store.put_tables(3, b)
    store.put_tables(5, a)  # steps need not be consecutive
    assert store.steps() == [3, 5]
    assert_identical(store.get_tables()["user"], a["user"])
    assert_identical(store.get_tables(3)["user"], b["user"])
    # Going back below the highest step needs a rollback (issue 10: lineage).
    with pytest.raises(cnrstore.StepOrderError, match="rollback"):
        store.put_tables(4, b)
    assert store.steps() == [3, 5]


def test_names_rows_and_device(store):
    tables = _tables()
    store.put_tables(1, tables)
    part = store.get_tables(1, names=["user"], rows={"user": slice(10, 50)}, device="cpu")
    assert list(part) == ["user"]
    assert_identical(part["user"], tables["user"][10:50])
    for sel in (slice(None, None, 7), slice(-5, None), slice(90, 10, -3), slice(60, 60)):
        got = store.get_tables(1, names=["item"], rows={"item": sel})["item"]
        want = tables["item"][torch.tensor(list(range(37))[sel], dtype=torch.int64)]
        assert_identical(got, want)


def test_unknown_step_and_table_are_key_errors(store):
    with pytest.raises(cnrstore.StepNotFound):
        store.get_tables()
    store.put_tables(1, _tables())
    with pytest.raises(KeyError):
        store.get_tables(2)
    with pytest.raises(cnrstore.TableNotFound):
        store.get_tables(1, names=["nope"])
    with pytest.raises(cnrstore.TableNotFound):
        store.get_tables(1, rows={"nope": slice(0, 1)})
    with pytest.raises(cnrstore.StepNotFound):
        store.delete_step(7)


def test_existing_step_is_refused_until_deleted(store):
    a, b = _tables(1), _tables(2)
    store.put_tables(1, a)
    with pytest.raises(cnrstore.StepExists):
        store.put_tables(1, b)
    assert_identical(store.get_tables(1)["user"], a["user"])
    store.delete_step(1)
    assert store.steps() == []
    store.put_tables(1, b)
    assert_identical(store.get_tables(1)["user"], b["user"])


def test_gc_keeps_the_asked_steps_and_frees_bytes(store):
    g = torch.Generator().manual_seed(3)
    versions = {}
    for step in range(5):
        versions[step] = {"t": random_table(g, 64, 4)}  # all rows new: nothing shared
        store.put_tables(step, versions[step])
    before = store.stats()
    rep = store.gc()  # neither given: nothing dropped
    assert rep.steps_deleted == () and store.steps() == [0, 1, 2, 3, 4]
    rep = store.gc(keep_last=2, keep=[0])
    assert isinstance(rep, cnrstore.GCReport)
    assert rep.steps_deleted == (1, 2) and rep.steps_kept == (0, 3, 4)
    assert rep.objects_freed > 0
    assert store.steps() == [0, 3, 4]
    for step in (0, 3, 4):
        assert_identical(store.get_tables(step)["t"], versions[step]["t"])
    after = store.stats()
    assert after.logical_bytes == before.logical_bytes * 3 // 5
    assert after.objects < before.objects
    with pytest.raises(cnrstore.InvalidInput):  # keep_last=0 would drop every step
        store.gc(keep_last=0)
    assert store.steps() == [0, 3, 4]


def test_stats_report_dedup(store):
    g = torch.Generator().manual_seed(5)
    t = {"big": random_table(g, 4096, 16)}  # large enough that disk blocks do not dominate
    store.put_tables(1, t)
    store.put_tables(2, t)  # identical: no new blocks
    st = store.stats()
    assert isinstance(st, cnrstore.StoreStats)
    assert st.steps == 2
    assert st.logical_bytes == 2 * sum(x.numel() * x.element_size() for x in t.values())
    assert st.dedup_ratio > 1.5
    assert st.objects > 0 and st.stored_bytes > 0


def test_verify_clean_store(store):
    if not isinstance(store.objects, engine.MemoryStore):
        pytest.importorskip("engine.store.verify")
    store.put_tables(1, _tables())
    t = _tables()
    t["user"][3] += 1
    store.put_tables(2, t)
    rep = store.verify()
    assert rep.ok and rep.problems == ()
    assert rep.steps_checked == 2 and rep.blocks_checked > 0


def test_verify_reports_a_corrupted_pack(tmp_path):
    pytest.importorskip("engine.store.verify")
    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(0)
    with cnrstore.open(path, block_rows=16) as s:
        s.put_tables(1, {"t": random_table(g, 256, 16)})
    packs = sorted(p for p in path.rglob("*.pack"))
    data_pack = max(packs, key=os.path.getsize)
    raw = bytearray(data_pack.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_pack.write_bytes(bytes(raw))
    with cnrstore.open(path, block_rows=16) as s:
        rep = s.verify()
        assert not rep.ok and rep.problems


def test_context_manager_and_reopen(tmp_path):
    path = tmp_path / "ckpt"
    t = _tables()
    with cnrstore.open(path) as s:
        s.put_tables(7, t, metadata={"epoch": 2})
    with pytest.raises(cnrstore.CheckpointError):
        s.get_tables(7)
    with cnrstore.open(path) as s:
        assert s.steps() == [7]
        for name, x in s.get_tables(7).items():
            assert_identical(x, t[name])


def test_non_blocking_put_returns_a_future(store):
    t = _tables()
    fut = store.put_tables(1, t, blocking=False)
    assert isinstance(fut, Future)
    info = fut.result(timeout=30)
    assert info.step == 1
    assert_identical(store.get_tables(1)["user"], t["user"])


def test_lossy_keeps_dtype_and_shape(store):
    t = _tables()
    store.put_tables(1, t, quant={"user": "int4", "item": "fp16"})
    got = store.get_tables(1)
    for name in t:
        assert got[name].dtype == t[name].dtype and got[name].shape == t[name].shape
    assert_identical(got["ids"], t["ids"])  # unnamed: exact
    assert not torch.equal(got["user"], t["user"])
    assert torch.allclose(got["user"], t["user"], atol=0.5)


def test_auto_quant_picks_from_expected_restores():
    from cnrstore.codec.autopolicy import auto_scheme
    from cnrstore.format.load import load_manifest

    for restores in (0, 1, 100):
        s = make_store("memory", None, expected_restores=restores)
        s.put_tables(1, _tables(), quant="auto")
        schemes = {n: tm.node.scheme for n, tm in load_manifest(s.objects, 1).tables.items()}
        assert schemes == {"user": auto_scheme(restores), "item": auto_scheme(restores),
                           "ids": "exact"}


def test_metadata_round_trips(store):
    store.put_tables(3, _tables(), metadata={"lr": 0.1, "tags": ["a", "b"], "epoch": 2})
    store.put_tables(4, _tables())
    assert store.metadata(3) == {"lr": 0.1, "tags": ["a", "b"], "epoch": 2}
    assert store.metadata() == {}
    with pytest.raises(cnrstore.StepNotFound):
        store.metadata(5)


def test_host_buffers_are_reused_within_their_budget():
    from cnrstore.core.snapshot import HostBuffers

    pool = HostBuffers(keep=2, max_bytes=1000)
    a = pool.take(600, pinned=False)
    pool.give(a)
    b = pool.take(500, pinned=False)
    assert b.data_ptr() == a.data_ptr()  # the same memory, not a fresh allocation
    pool.give(b)
    pool.give(torch.empty(700, dtype=torch.uint8))
    assert pool.held_bytes() <= 1000  # over budget: the largest was dropped
    pool.give(torch.empty(5000, dtype=torch.uint8))
    assert pool.held_bytes() <= 1000


def test_host_buffers_keep_one_per_table_of_a_put_within_their_budget():
    """A put of more tables than ``keep`` takes a buffer per table: all are kept for the
    next put (a freed one was first-touched afresh in the next put's stall, issue 27)."""
    from cnrstore.core.snapshot import HostBuffers

    pool = HostBuffers(keep=2, max_bytes=10_000)
    sizes = (1000, 2000, 3000, 1500)
    first = [pool.take(n, pinned=False) for n in sizes]
    for b in first:
        pool.give(b)
    again = [pool.take(n, pinned=False) for n in sizes]
    assert {b.data_ptr() for b in again} == {b.data_ptr() for b in first}
    for b in again:
        pool.give(b)
    pool.give(torch.empty(9000, dtype=torch.uint8))
    assert pool.held_bytes() <= 10_000  # the byte budget still holds


def test_gc_keep_last_larger_than_the_number_of_steps(store):
    for step in (1, 2):
        store.put_tables(step, _tables(step))
    rep = store.gc(keep_last=5)
    assert rep.steps_deleted == () and store.steps() == [1, 2]

"""Errors that escaped cnrstore's tree or came late (issue 23): each is a CheckpointError
subclass raised before anything is written, with a message that says what to do; and
load_state adopts what a fresh optimizer creates lazily."""

from __future__ import annotations

import os

import pytest
import torch

import cnrstore


@pytest.fixture
def store(tmp_path):
    with cnrstore.open(tmp_path / "s", block_rows=8) as s:
        s.put_state(1, {"a": torch.arange(64.0).reshape(16, 4), "b": torch.ones(16, 4),
                        "n": 3})
        yield s


# -- destinations a restore cannot write (item 11) ------------------------------------------

BAD_DESTINATIONS = [
    pytest.param(lambda: torch.zeros(1, 4).expand(16, 4), "share memory", id="expand"),
    pytest.param(lambda: torch.zeros(4).expand(16, 4), "share memory", id="expand-row"),
    pytest.param(lambda: torch.zeros(20).as_strided((16, 4), (1, 1)), "share memory",
                 id="as_strided"),
    pytest.param(lambda: torch.empty(16, 4, device="meta"), "meta", id="meta"),
]


@pytest.mark.parametrize("make, words", BAD_DESTINATIONS)
def test_get_tables_out_refuses_before_writing(store, make, words):
    first = torch.full((16, 4), -1.0)  # restored first, in mapping order
    with pytest.raises(cnrstore.InvalidInput, match=words) as info:
        store.get_tables(1, out={"a": first, "b": make()})
    assert "nothing was written" in str(info.value) and "'b'" in str(info.value)
    assert torch.equal(first, torch.full((16, 4), -1.0))


@pytest.mark.parametrize("make, words", BAD_DESTINATIONS)
def test_load_state_refuses_before_writing(store, make, words):
    first = torch.full((16, 4), -1.0)
    with pytest.raises(cnrstore.InvalidInput, match=words) as info:
        store.load_state(1, {"a": first, "b": make(), "n": 0})
    assert "state entry 'b'" in str(info.value)
    assert torch.equal(first, torch.full((16, 4), -1.0))


def test_views_that_do_not_overlap_are_still_restored_in_place(store):
    buf = torch.zeros(16, 8)
    out = {"a": buf[:, :4], "b": buf[:, 4:]}  # interleaved columns: disjoint elements
    store.get_tables(1, out=out)
    assert torch.equal(buf[:, :4], torch.arange(64.0).reshape(16, 4))
    assert torch.equal(buf[:, 4:], torch.ones(16, 4))
    t = torch.zeros(4, 16).t()  # transposed
    store.load_state(1, {"a": t}, strict=False)
    assert torch.equal(t, torch.arange(64.0).reshape(16, 4))


# -- a fresh optimizer's lazily created state (item 3) --------------------------------------

def test_load_state_fills_empty_containers_and_leaves_named_ones_alone(tmp_path):
    with cnrstore.open(tmp_path / "s") as s:
        s.put_state(1, {"opt": {"state": {0: {"m": torch.full((3,), 2.0)},
                                          1: {"m": torch.full((2, 2), 5.0)}},
                                "groups": [{"lr": 0.5}]},
                        "model": {"w": torch.ones(3), "v": torch.ones(2)}, "epoch": 4})
        given = {"opt": {"state": {}, "groups": [{"lr": 0.1}]}, "model": {"w": torch.zeros(3)}}
        got = s.load_state(1, given, strict=False)
        assert sorted(got["opt"]["state"]) == [0, 1]
        assert torch.equal(got["opt"]["state"][1]["m"], torch.full((2, 2), 5.0))
        assert got["opt"]["groups"] == [{"lr": 0.5}]
        assert given["opt"]["state"] == {}          # the caller's containers are not changed
        assert set(got["model"]) == {"w"}           # a named, non-empty dict is not extended
        assert set(got) == {"opt", "model"}         # nor is the root: "epoch" stays out
        assert torch.equal(given["model"]["w"], torch.ones(3))  # in place


# -- puts of what a plain store cannot take (items 13, 15) ----------------------------------

@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["csr", "csc", "coo"])
def test_sparse_tensors_are_refused_up_front(store, layout):
    dense = torch.eye(8)
    t = {"csr": dense.to_sparse_csr, "csc": dense.to_sparse_csc, "coo": dense.to_sparse}[layout]()
    for put in (lambda: store.put_state(2, {"w": t}), lambda: store.put_tables(2, {"w": t})):
        with pytest.raises(cnrstore.InvalidInput, match="'w'.*sparse.*to_dense"):
            put()
    assert store.steps() == [1]


def test_a_shard_on_a_plain_store_says_it_needs_group(store):
    shard = cnrstore.Shard(torch.ones(4, 4), row_offset=0, rows=4)
    for call in (lambda: store.put_tables(2, {"w": shard}),
                 lambda: store.put_state(2, {"model": {"w": shard}}),
                 lambda: store.get_tables(1, out={"a": shard}),
                 lambda: store.load_state(1, {"a": shard}, strict=False)):
        with pytest.raises(cnrstore.InvalidType, match="Shard.*group="):
            call()
    assert store.steps() == [1]


def test_deep_metadata_and_state_are_invalid_input(store):
    deep: dict = {}
    for _ in range(100_000):
        deep = {"a": deep}
    with pytest.raises(cnrstore.InvalidInput, match="metadata"):
        store.put_tables(2, {"t": torch.ones(2, 2)}, metadata=deep)
    with pytest.raises(cnrstore.InvalidInput, match="deeper"):
        store.put_state(2, {"t": torch.ones(2, 2), "deep": deep})
    assert store.steps() == [1]


# -- read-only stores, missing stores, the guide's imports (item 13) ------------------------

def test_read_only_writes_are_read_only_store_without_paths(tmp_path):
    path = tmp_path / "ro"
    with cnrstore.open(path) as s:
        s.put_tables(1, {"t": torch.ones(4, 2)})
        s.put_tables(2, {"t": torch.zeros(4, 2)})
    with cnrstore.open(path, readonly=True) as s:
        for what, call in [("put_tables", lambda: s.put_tables(3, {"t": torch.ones(4, 2)})),
                           ("put_tables", lambda: s.put_state(3, {"t": torch.ones(4, 2)})),
                           ("delete_step", lambda: s.delete_step(1)),
                           ("delete_steps", lambda: s.delete_steps([1])),
                           ("rollback", lambda: s.rollback(1)),
                           ("gc", lambda: s.gc(keep_last=1))]:
            with pytest.raises(cnrstore.ReadOnlyStore) as info:
                call()
            assert str(info.value).startswith(what) and "readonly=True" in str(info.value)
            assert str(tmp_path) not in str(info.value)  # an S3 store's cache is no concern
        assert s.steps() == [1, 2]


def test_open_without_create_where_there_is_no_store_is_bad_path(tmp_path):
    os.mkdir(tmp_path / "empty")
    (tmp_path / "file").write_bytes(b"x")
    for where, kw in [("missing", {"create": False}), ("empty", {"create": False}),
                      ("missing", {"readonly": True}), ("file", {})]:
        with pytest.raises(cnrstore.BadPath) as info:
            cnrstore.open(tmp_path / where, **kw)
        assert info.value.path == str(tmp_path / where)
    assert not (tmp_path / "missing").exists()
    assert os.listdir(tmp_path / "empty") == []


def test_the_guides_tool_imports_work():
    from cnrstore import inspect, transfer

    assert callable(inspect.list_steps) and callable(inspect.diff_steps)
    assert callable(transfer.export_step) and callable(transfer.import_step)
    assert "inspect" in dir(cnrstore) and "inspect" not in cnrstore.__all__

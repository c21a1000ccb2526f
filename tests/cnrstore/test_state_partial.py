"""Loads of part of a state (issue 25, part 3): get_state / load_state with ``names=``
read the picked leaves and nothing else, counted as the objects fetched from the engine."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import assert_identical
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cnrstore
import engine
from cnrstore.core.stateselect import leaf_names
from cnrstore.format.load import load_step


class CountingStore(engine.MemoryStore):
    """A MemoryStore that records every object id whose payload is read."""

    def __init__(self):
        super().__init__()
        self.fetched: list[bytes] = []

    def get(self, oid):
        self.fetched.append(bytes(oid))
        return super().get(oid)

    def info(self, oid):  # the index, not a read of the payload
        obj = self._objects[bytes(oid)][0]
        n = len(obj.payload)
        return engine.ObjectInfo(obj.kind, obj.refs, n, n, self._objects[bytes(oid)][1])


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"emb.weight": torch.randn(300, 8, generator=g),
                  "bias": torch.randn(8, generator=g)},
        "optim": {"state": {0: {"exp_avg": torch.randn(300, 8, generator=g),
                                "step": torch.tensor(float(seed))}},
                  "param_groups": [{"lr": 0.1 * seed, "params": [0]}]},
        "seq": [torch.randn(40, 2, generator=g), seed, torch.randn(3, generator=g)],
        "epoch": seed,
    }


def _zeroed(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeroed(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeroed(v) for v in state]
    return -1 if isinstance(state, int) and not isinstance(state, bool) else state


def _reach(objects: CountingStore, oid: bytes) -> set[bytes]:
    seen, todo = set(), [oid]
    while todo:
        o = todo.pop()
        if o not in seen:
            seen.add(o)
            todo.extend(objects.info(o).refs)
    return seen


def _closures(objects: CountingStore, step: int) -> dict[str, set[bytes]]:
    _, node = load_step(objects, step)
    return {n: _reach(objects, t) for n, t in zip(node.tables, node.table_ids)}


@pytest.fixture
def store():
    objects = CountingStore()
    s = cnrstore.CheckpointStore(objects, block_rows=64, fanout=4)
    s.put_state(1, _state(1))
    s.put_state(2, _state(2), quant={"model/emb.weight": "int8"})
    yield s, objects
    s.close()


def _read_only(objects: CountingStore, step: int, picked: set[str]) -> None:
    """Every object fetched lies under a picked table or is one of the step's own nodes;
    every object of a picked table was fetched."""
    got = set(objects.fetched)
    closures = _closures(objects, step)
    objects.fetched.clear()
    mine = set().union(*(closures[n] for n in picked)) if picked else set()
    others = set().union(*(c for n, c in closures.items() if n not in picked)) - mine
    assert not got & others, sorted(n for n, c in closures.items() if c & got - mine)
    assert mine <= got


def test_get_state_reads_the_picked_leaves_only(store):
    s, objects = store
    full = s.get_state(2)
    objects.fetched.clear()
    part = s.get_state(2, names=["model/*", "epoch"])
    assert list(part) == ["model", "epoch"] and part["epoch"] == 2
    assert list(part["model"]) == ["emb.weight", "bias"]
    for k in part["model"]:
        assert_identical(part["model"][k], full["model"][k])
    _read_only(objects, 2, {"model/emb.weight", "model/bias"})


def test_a_list_keeps_its_length_with_none_where_nothing_was_picked(store):
    s, objects = store
    objects.fetched.clear()
    part = s.get_state(None, names=["seq/2", "optim/param_groups/0/lr"])
    assert part["seq"][:2] == [None, None] and len(part["seq"]) == 3
    assert_identical(part["seq"][2], _state(2)["seq"][2])
    assert part["optim"] == {"param_groups": [{"lr": 0.1 * 2}]}
    _read_only(objects, 2, {"seq/2"})


def test_nothing_picked_but_python_leaves_reads_no_table(store):
    s, objects = store
    objects.fetched.clear()
    assert s.get_state(2, names=["epoch", "seq/1"]) == {"seq": [None, 2, None], "epoch": 2}
    _read_only(objects, 2, set())


def test_load_state_restores_the_picked_entries_and_leaves_the_rest(store):
    s, objects = store
    dest = _zeroed(_state(0))
    objects.fetched.clear()
    back = s.load_state(1, dest, names=["optim/*"])
    want = _state(1)
    assert_identical(dest["optim"]["state"][0]["exp_avg"], want["optim"]["state"][0]["exp_avg"])
    assert back["optim"]["param_groups"][0]["lr"] == 0.1
    assert torch.count_nonzero(dest["model"]["emb.weight"]) == 0  # left alone
    assert back["epoch"] == -1 and back["seq"][1] == -1
    _read_only(objects, 1, {"optim/state/0/exp_avg", "optim/state/0/step"})


def test_load_state_fills_a_fresh_optimizer_from_the_picked_entries_only(store):
    s, objects = store
    dest = {"optim": {"state": {}, "param_groups": [{"lr": 9.0, "params": [0]}]}}
    objects.fetched.clear()
    back = s.load_state(2, dest, names=["optim/state/*/exp_avg", "optim/param_groups/*"])
    assert list(back["optim"]["state"][0]) == ["exp_avg"]
    assert_identical(back["optim"]["state"][0]["exp_avg"], _state(2)["optim"]["state"][0]
                     ["exp_avg"])
    assert back["optim"]["param_groups"] == [{"lr": 0.2, "params": [0]}]
    _read_only(objects, 2, {"optim/state/0/exp_avg"})


def test_names_that_match_nothing_are_errors_before_anything_is_read(store):
    s, objects = store
    dest = _zeroed(_state(0))
    for names, err in ((["model/*", "modle/*"], cnrstore.InvalidInput),
                       (["model/emb.weight", "model/nope"], cnrstore.TableNotFound),
                       ("model/*", cnrstore.InvalidType), ([3], cnrstore.InvalidType)):
        objects.fetched.clear()
        with pytest.raises(err):
            s.get_state(2, names=names)
        with pytest.raises(err):
            s.load_state(2, dest, names=names)
        _read_only(objects, 2, set())
    assert torch.count_nonzero(dest["model"]["emb.weight"]) == 0


def test_strict_load_names_an_entry_the_step_lacks(store):
    s, _ = store
    dest = _zeroed(_state(0))
    dest["model"]["extra"] = torch.zeros(3)
    with pytest.raises(cnrstore.TableNotFound):
        s.load_state(2, dest, names=["model/*"])
    assert torch.count_nonzero(dest["model"]["emb.weight"]) == 0
    s.load_state(2, dest, names=["model/*"], strict=False)
    assert_identical(dest["model"]["bias"], _state(2)["model"]["bias"])
    dest = {"model": {"bias": torch.zeros(8)}, "epoch": 0, "extra": 0.5}
    with pytest.raises(cnrstore.InvalidInput, match="'extra'"):  # e* picks it, unstored
        s.load_state(2, dest, names=["model/bias", "e*"])
    assert torch.count_nonzero(dest["model"]["bias"]) == 0
    assert s.load_state(2, dest, names=["model/bias", "e*"], strict=False) == {
        "model": {"bias": dest["model"]["bias"]}, "epoch": 2, "extra": 0.5}


def test_a_put_tables_step_picks_tables():
    objects = CountingStore()
    with cnrstore.CheckpointStore(objects, block_rows=64) as s:
        t = {"a": torch.randn(100, 4), "b": torch.randn(100, 4), "ab": torch.arange(7)}
        s.put_tables(1, t)
        objects.fetched.clear()
        got = s.get_state(1, names=["a*"])
        assert list(got) == ["a", "ab"]
        _read_only(objects, 1, {"a", "ab"})
        dest = {"a": torch.zeros(100, 4), "b": torch.zeros(100, 4)}
        s.load_state(1, dest, names=["b"])
        assert_identical(dest["b"], t["b"])
        assert torch.count_nonzero(dest["a"]) == 0
        _read_only(objects, 1, {"b"})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_pick_gives_the_picked_leaves_of_the_whole_state(data):
    objects = CountingStore()
    with cnrstore.CheckpointStore(objects, block_rows=64) as s:
        s.put_state(3, _state(3))
        full = s.get_state(3)
        stored = leaf_names(load_step(objects, 3)[1].state)
        picked = data.draw(st.lists(st.sampled_from(stored), min_size=1, unique=True))
        objects.fetched.clear()
        part = s.get_state(3, names=picked)
        _read_only(objects, 3, set(picked) & set(load_step(objects, 3)[1].tables))

        def leaves(v, path=""):
            if isinstance(v, dict):
                for k, c in v.items():
                    yield from leaves(c, f"{path}/{k}" if path else str(k))
            elif isinstance(v, list):
                for i, c in enumerate(v):
                    yield from leaves(c, f"{path}/{i}" if path else str(i))
            else:
                yield path, v

        want = dict(leaves(full))
        got = {p: v for p, v in leaves(part) if p in picked}
        assert sorted(got) == sorted(picked)
        for p, v in got.items():
            if isinstance(v, torch.Tensor):
                assert_identical(v, want[p])
            else:
                assert v == want[p]
        # what was not picked is absent, or a None hole in a list
        assert all(v is None for p, v in leaves(part) if p not in picked)

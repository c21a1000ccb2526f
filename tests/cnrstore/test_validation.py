"""Bad input gets a clear error before anything is written; the store and the diff base stay
as they were (docs/GUIDE.md, "The API contract")."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import assert_identical, make_store, random_table

import cnrstore


@pytest.fixture(params=["memory", "pack"])
def store(request, tmp_path):
    s = make_store(request.param, tmp_path / "ckpt", block_rows=8, fanout=4)
    yield s
    s.close()


def _snapshot(store):
    return store.steps(), store.stats().objects


def _good():
    g = torch.Generator().manual_seed(0)
    return {"f": random_table(g, 20, 4), "i": random_table(g, 10, dtype=torch.int32)}


BAD_PUTS = [
    # (step, tables, kwargs, error type, words the message must contain)
    (-1, None, {}, cnrstore.InvalidInput, ["step", ">= 0"]),
    (1.5, None, {}, TypeError, ["step", "int"]),
    (True, None, {}, TypeError, ["step"]),
    (1, [torch.zeros(3)], {}, TypeError, ["mapping"]),
    (1, {"": torch.zeros(3)}, {}, ValueError, ["non-empty"]),
    (1, {3: torch.zeros(3)}, {}, ValueError, ["names"]),
    (1, {"x": [1.0, 2.0]}, {}, TypeError, ["'x'", "Tensor"]),
    (1, {"x": torch.tensor(1.0)}, {}, ValueError, ["'x'", "ndim"]),
    (1, None, {"quant": "int9"}, cnrstore.UnknownScheme, ["int9"]),
    (1, None, {"quant": 8}, TypeError, ["quant"]),
    (1, None, {"quant": {"f": "int8"}}, None, []),  # valid: control case
    (1, None, {"quant": {"F": "int8"}}, ValueError, ["'F'"]),
    (1, None, {"quant": {"*": "int8", "i": "exact"}}, None, []),  # valid: "*" for the rest
    # A wildcard skips int tables (issue 10); one that matches only them is a typo.
    (1, None, {"quant": {"*": "int8"}}, None, []),
    (1, None, {"quant": {"i*": "int8"}}, cnrstore.InvalidInput, ["'i*'"]),
    (1, None, {"quant": {"x*": "int8"}}, cnrstore.InvalidInput, ["'x*'"]),
    (1, None, {"quant": "int8"}, cnrstore.UnknownScheme, ["i"]),  # lossy on an int table
    (1, None, {"quant": {"i": "fp16"}}, ValueError, ["i"]),
    (1, None, {"metadata": {"x": object()}}, ValueError, ["metadata"]),
    (1, None, {"metadata": [1]}, TypeError, ["metadata"]),
    (1, None, {"touched": {"f": [0, 99]}}, ValueError, ["touched", "f"]),
    (1, None, {"touched": {"g": [0]}}, ValueError, ["'g'"]),
    (1, None, {"touched": {"f": [0.5]}}, TypeError, ["touched"]),
]


@pytest.mark.parametrize("step, tables, kwargs, exc, words", BAD_PUTS)
def test_bad_put_is_refused_and_changes_nothing(store, step, tables, kwargs, exc, words):
    store.put_tables(0, _good())
    before = _snapshot(store)
    tables = _good() if tables is None else tables
    if exc is None:
        store.put_tables(step, tables, **kwargs)
        return
    with pytest.raises(exc) as info:
        store.put_tables(step, tables, **kwargs)
    assert isinstance(info.value, cnrstore.CheckpointError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert _snapshot(store) == before


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_under_lossy_names_table_and_first_bad_row(store, bad):
    t = _good()
    t["f"][13, 2] = bad
    t["f"][17, 0] = bad
    with pytest.raises(cnrstore.NonFiniteValues) as info:
        store.put_tables(1, t, quant={"f": "int8"})
    assert info.value.table == "f" and info.value.row == 13
    assert "'f'" in str(info.value) and "13" in str(info.value)
    assert store.steps() == []
    store.put_tables(1, t)  # exact takes NaN/Inf
    assert_identical(store.get_tables(1)["f"], t["f"])


def test_refused_put_leaves_the_diff_base(store):
    t = _good()
    store.put_tables(1, t)
    t["f"][2] += 1.0
    bad = dict(t, g=torch.tensor(0.0))  # refused: ndim 0
    with pytest.raises(cnrstore.InvalidInput):
        store.put_tables(2, bad)
    nan = {"f": t["f"].clone()}
    nan["f"][5] = float("nan")
    with pytest.raises(cnrstore.NonFiniteValues):  # refused during planning
        store.put_tables(2, nan, quant="fp16")
    info = store.put_tables(2, t)
    # Still diffing against step 1: only row 2 changed.
    assert info.rows_changed == {"f": 1, "i": 0}


def test_existing_step_refused_while_pending(store):
    t = _good()
    fut = store.put_tables(4, t, blocking=False)
    with pytest.raises(cnrstore.StepExists):
        store.put_tables(4, t)
    fut.result()
    with pytest.raises(cnrstore.StepExists):
        store.put_tables(4, t, blocking=False)
    assert store.steps() == [4]


def test_bad_get_arguments(store):
    store.put_tables(1, _good())
    with pytest.raises(TypeError):
        store.get_tables(1, names="f")
    with pytest.raises(TypeError):
        store.get_tables(1, rows={"f": [1, 2]})
    with pytest.raises(ValueError):
        store.get_tables(1, device="warp-drive")
    with pytest.raises(ValueError):
        store.get_tables(-3)
    with pytest.raises(ValueError):
        store.gc(keep_last=-1)
    with pytest.raises(TypeError):
        store.gc(keep=5)


def test_bad_options_are_refused(tmp_path):
    for opts in ({"block_rows": 0}, {"fanout": 0}, {"max_inflight": 0}, {"block_rows": 2.5}):
        with pytest.raises(ValueError):
            make_store("memory", None, **opts)
    with pytest.raises(ValueError):
        cnrstore.CheckpointStore("not a store")


def test_nonfinite_found_while_comparing_seeded_codes(store):
    g = torch.Generator().manual_seed(1)
    t = random_table(g, 40, 4)
    store.put_tables(1, {"f": t}, quant="int8")
    fresh = type(store)(store.objects, block_rows=8, fanout=4)  # seeds from step 1's codes
    t[33, 1] = float("nan")
    with pytest.raises(cnrstore.NonFiniteValues) as info:
        fresh.put_tables(2, {"f": t}, quant="int8")
    assert info.value.table == "f" and info.value.row == 33
    assert store.steps() == [1]
    fresh.close()

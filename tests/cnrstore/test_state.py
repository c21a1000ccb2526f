"""Whole training state (issue 10): put_state / get_state / load_state over nestings of
dicts, lists and tuples, quant patterns, and in-place restores into existing tensors."""

from __future__ import annotations

import math

import pytest
import torch
from ckpt_util import assert_identical, make_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cnrstore
from cnrstore.format.load import load_manifest

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.uint8, torch.bool]


def _same(got, want, path="") -> None:
    """Equal nestings: container and key types, dict order, tensor bits, Python values."""
    assert type(got) is type(want) or (isinstance(want, dict) and type(got) is dict), (
        path, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert_identical(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        assert [type(k) for k in got] == [type(k) for k in want], path
        for k in want:
            _same(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{path}/{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want, path


@st.composite
def _tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


_python = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=True) | st.text(max_size=5) | st.binary(max_size=5))
_keys = st.integers(-3, 50) | st.text(alphabet="ab.x_0", min_size=1, max_size=3)


def _unique_text(d: dict) -> bool:
    return len({str(k) for k in d}) == len(d)


_nesting = st.recursive(
    _tensors() | _python,
    lambda kids: (st.lists(kids, max_size=3) | st.lists(kids, max_size=3).map(tuple)
                  | st.dictionaries(_keys, kids, max_size=3).filter(_unique_text)),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=st.dictionaries(_keys, _nesting, max_size=4).filter(_unique_text))
def test_random_nestings_round_trip(state):
    s = make_store("memory", None, block_rows=3, fanout=2)
    s.put_state(1, state)
    _same(s.get_state(1), state)
    _same(s.get_state(), state)
    # load_state into a blank copy: tensors filled in place, Python leaves as stored.
    blank = _blank(state)
    _same(s.load_state(1, blank), state)


def _blank(x):
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return {k: _blank(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_blank(v) for v in x)
    return None


def test_state_tables_are_named_by_path_and_small_tensors_stay_exact(tmp_path):
    s = make_store("pack", tmp_path / "s")
    state = {"model": {"emb.weight": torch.randn(40, 4), "bias": torch.randn(4)},
             "optim": {"state": {0: {"step": torch.tensor(3.0), "sum": torch.rand(40, 4)}},
                       "param_groups": [{"lr": 0.1, "params": [0]}]},
             "epoch": 3, "rng": torch.get_rng_state()}
    info = s.put_state(1, state, quant={"model/emb*": "int8", "optim/state/*/sum": "fp16"})
    assert sorted(info.rows_changed) == sorted(
        ["model/emb.weight", "model/bias", "optim/state/0/step", "optim/state/0/sum", "rng"])
    manifest = load_manifest(s.objects, 1)
    assert info.tables == {n: tm.oid.hex() for n, tm in manifest.tables.items()}  # GUIDE's contract
    schemes = {n: tm.node.scheme for n, tm in manifest.tables.items()}
    assert schemes == {"model/emb.weight": "int8", "model/bias": "exact", "rng": "exact",
                       "optim/state/0/step": "exact", "optim/state/0/sum": "fp16"}
    # One scheme for a whole state quantizes the float tensors of ndim >= 2 only.
    s.put_state(2, state, quant="int8")
    schemes = {n: tm.node.scheme for n, tm in load_manifest(s.objects, 2).tables.items()}
    assert schemes["model/emb.weight"] == schemes["optim/state/0/sum"] == "int8"
    assert schemes["rng"] == schemes["model/bias"] == "exact"
    # touched= takes the same names.
    state["model"]["emb.weight"][3] += 1.0
    info = s.put_state(3, state, quant="int8", touched={"model/emb.weight": [3]})
    assert info.rows_changed["model/emb.weight"] == 1
    got = s.get_state(1)
    assert got["optim"]["state"][0]["step"].shape == ()
    assert_identical(got["rng"], state["rng"])
    assert got["epoch"] == 3 and got["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert s.metadata(1) == {}


@pytest.mark.parametrize("bad, exc, word", [
    ({"a/b": torch.zeros(2)}, cnrstore.InvalidInput, "'a/b'"),
    ({"a": {1.5: torch.zeros(2)}}, cnrstore.InvalidType, "1.5"),
    ({"a": {True: 1}}, cnrstore.InvalidType, "True"),
    ({"a": {"": 1}}, cnrstore.InvalidInput, "empty"),
    ({"a": {1: torch.zeros(2), "1": torch.zeros(2)}}, cnrstore.InvalidInput, "a/1"),
    ({"a": object()}, cnrstore.InvalidType, "'a'"),
    ({"a": 2**70}, cnrstore.InvalidInput, "64 bits"),
    (torch.zeros(3), cnrstore.InvalidType, "dict"),
])
def test_bad_states_are_refused_before_writing(bad, exc, word):
    s = make_store("memory", None)
    with pytest.raises(exc) as info:
        s.put_state(1, bad)
    assert word in str(info.value)
    assert s.steps() == []


def test_quant_patterns_first_match_wins_and_typos_are_errors():
    s = make_store("memory", None)
    t = {"emb0": torch.randn(8, 4), "emb1": torch.randn(8, 4), "mlp.w": torch.randn(4, 4),
         "mlp.b": torch.randn(4), "ids": torch.arange(8)}
    s.put_tables(1, t, quant={"emb0": "fp16", "emb*": "int8", "*": "int4"})
    schemes = {n: tm.node.scheme for n, tm in load_manifest(s.objects, 1).tables.items()}
    assert schemes == {"emb0": "fp16", "emb1": "int8", "mlp.w": "int4", "mlp.b": "exact",
                       "ids": "exact"}
    for quant, word in [({"emm*": "int8"}, "emm*"), ({"mlp.b": "int8"}, "fewer than 2"),
                        ({"*.b": "fp16"}, "fewer than 2"), ({"embX": "int8"}, "embX")]:
        with pytest.raises(cnrstore.InvalidInput, match=word.replace("*", r"\*")):
            s.put_tables(2, t, quant=quant)
    assert s.steps() == [1]
    s.put_tables(2, t, quant={"*.b": "exact", "emb?": "int8"})  # exact on 1-D is fine


def test_get_tables_out_restores_in_place_and_checks_everything_first(tmp_path):
    s = make_store("pack", tmp_path / "s", block_rows=16)
    g = torch.Generator().manual_seed(0)
    t = {"a": torch.randn(100, 8, generator=g), "b": torch.randn(50, 3, generator=g),
         "q": torch.randn(70, 5, generator=g), "v": torch.arange(9)}
    s.put_tables(1, t, quant={"q": "int8"})
    want = s.get_tables(1)
    out = {n: torch.zeros_like(x) for n, x in t.items()}
    ptrs = {n: x.data_ptr() for n, x in out.items()}
    got = s.get_tables(1, out=out)
    for n in t:
        assert got[n] is out[n] and out[n].data_ptr() == ptrs[n]
        assert_identical(out[n], want[n])
    # A non-contiguous destination works too (block-sized staging).
    wide = torch.zeros(8, 100).t()
    s.get_tables(1, out={"a": wide})
    assert_identical(wide.contiguous(), want["a"])
    # One bad destination: nothing is written to the good ones.
    fresh = {"a": torch.zeros(100, 8), "b": torch.zeros(50, 4)}
    with pytest.raises(cnrstore.InvalidInput, match="'b'"):
        s.get_tables(1, out=fresh)
    with pytest.raises(cnrstore.InvalidInput):
        s.get_tables(1, out={"a": torch.zeros(100, 8, dtype=torch.float64)})
    with pytest.raises(cnrstore.TableNotFound):
        s.get_tables(1, out={"a": fresh["a"], "zz": torch.zeros(1)})
    assert not fresh["a"].any()


def test_in_place_restore_seeds_the_diff_base(tmp_path):
    path = tmp_path / "s"
    g = torch.Generator().manual_seed(1)
    t = {"a": torch.randn(4096, 16, generator=g), "q": torch.randn(4096, 16, generator=g)}
    with make_store("pack", path, block_rows=256) as s:
        s.put_tables(1, t, quant={"q": "int8"})
    with make_store("pack", path, block_rows=256, seed_from_store=False) as s:
        out = {n: torch.empty_like(x) for n, x in t.items()}
        s.get_tables(out=out)
        out["a"][7] += 1
        out["q"][9] += 1
        info = s.put_tables(2, out, quant={"q": "int8"})
        assert info.rows_changed == {"a": 1, "q": 1}
        assert info.bytes_written < 40_000  # two patched blocks, not 512 KiB of tables


def _model_state():
    g = torch.Generator().manual_seed(5)
    return {"model": {"w": torch.randn(20, 4, generator=g), "b": torch.randn(4, generator=g)},
            "optim": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [
                {"lr": 0.5, "betas": (0.9, 0.99), "params": [0, 1], "foreach": None}]},
            "epoch": 7}


def test_load_state_in_place_returns_python_values_and_is_all_or_nothing():
    s = make_store("memory", None)
    state = _model_state()
    s.put_state(3, state)
    target = _model_state()
    for t in (target["model"]["w"], target["model"]["b"], target["optim"]["state"][0]["step"]):
        t.zero_()
    target["epoch"] = 0
    target["optim"]["param_groups"][0]["lr"] = 9.0
    ptr = target["model"]["w"].data_ptr()
    got = s.load_state(3, target)
    _same(got, state)
    assert target["model"]["w"].data_ptr() == ptr
    assert_identical(target["model"]["w"], state["model"]["w"])  # in place
    assert target["optim"]["state"][0]["step"].item() == 2.0
    # Partial: entries the caller does not name are left alone.
    part = {"model": {"b": torch.zeros(4)}}
    assert_identical(s.load_state(3, part)["model"]["b"], state["model"]["b"])
    # Strict: a name the step lacks, or a shape that differs, writes nothing.
    for bad in ({"model": {"w": torch.zeros(20, 4), "extra": torch.zeros(3)}},
                {"model": {"w": torch.zeros(20, 4), "b": torch.zeros(5)}},
                {"model": {"w": torch.zeros(20, 4)}, "optim": {"state": {0: {
                    "step": torch.zeros(1)}}}},
                {"model": {"w": torch.zeros(20, 4)}, "nothere": 3}):
        with pytest.raises(cnrstore.CheckpointError):
            s.load_state(3, bad)
        assert not bad["model"]["w"].any()
    loose = {"model": {"w": torch.zeros(20, 4), "extra": torch.ones(3)}}
    s.load_state(3, loose, strict=False)
    assert_identical(loose["model"]["w"], state["model"]["w"])
    assert loose["model"]["extra"].eq(1).all()


def test_get_state_of_a_put_tables_step_is_its_tables():
    s = make_store("memory", None)
    t = {"a": torch.randn(5, 2)}
    s.put_tables(1, t)
    _same(s.get_state(1), t)
    target = {"a": torch.zeros(5, 2)}
    s.load_state(1, target)
    assert_identical(target["a"], t["a"])
    with pytest.raises(cnrstore.InvalidInput, match="put_tables"):
        s.load_state(1, {"a": torch.zeros(5, 2), "epoch": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_get_tables_out_and_load_state_on_cuda():
    s = make_store("memory", None, block_rows=32)
    g = torch.Generator().manual_seed(2)
    t = {"a": torch.randn(100, 8, generator=g), "q": torch.randn(70, 5, generator=g)}
    s.put_tables(1, t, quant={"q": "int8"})
    want = s.get_tables(1)
    out = {n: torch.zeros(x.shape, device="cuda") for n, x in t.items()}
    ptrs = {n: x.data_ptr() for n, x in out.items()}
    s.get_tables(1, out=out)
    for n in t:
        assert out[n].device.type == "cuda" and out[n].data_ptr() == ptrs[n]
        assert_identical(out[n].cpu(), want[n])
    out["a"][5] += 1  # the restore seeded the diff base: the next put is incremental
    assert s.put_tables(2, out, quant={"q": "int8"}).rows_changed == {"a": 1, "q": 0}
    model = nn_state = {"w": torch.zeros(100, 8, device="cuda"), "n": 0}
    s.put_state(3, {"w": t["a"], "n": 4})
    assert s.load_state(3, nn_state)["n"] == 4
    assert_identical(model["w"].cpu(), t["a"])


def test_a_crafted_state_structure_is_a_manifest_error():
    import time

    from cnrstore.format.load import load_step
    from cnrstore.format.manifest import KIND_STEP, StepNode, root_name

    s = make_store("memory", None)
    s.put_state(1, {"w": torch.zeros(4, 2)})
    _, node = load_step(s.objects, 1)
    bad_docs = [{"d": [["w", {"T": "w", "shape": [3, 3]}]]},   # shape does not fit
                {"d": [["w", {"T": "zz", "shape": [4, 2]}]]},  # names another table
                {"d": [["w", {"q": 1}]]},                      # unknown node
                {"d": [[1.5, {"p": 1}]]}]                      # bad key type
    for step, doc in enumerate(bad_docs, start=2):
        payload, refs = StepNode(step, time.time(), node.tables, node.table_ids,
                                 state=doc).encode()
        with s.objects.writer() as w:
            w.set_root(root_name(step), w.put(KIND_STEP, payload, refs, meta=True))
        with pytest.raises(cnrstore.ManifestError):
            s.get_state(step)
        with pytest.raises(cnrstore.CheckpointError):
            s.load_state(step, {"w": torch.zeros(4, 2)})

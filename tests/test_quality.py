"""The quality experiment (benches/quality.py, quality_tasks.py, quality_report.py): its
pairing is exact and checked, its statistics and the auto thresholds it derives are right,
MovieLens-100k is read as the CTR task it claims, and the store's auto rule is the one the
committed measurement (docs/quality/results.json) supports."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cnrstore.codec import autopolicy
from cnrstore.codec.autopolicy import auto_scheme
from cnrstore.demo.dlrm import deterministic

_BENCHES = Path(__file__).resolve().parents[1] / "benches"
_RESULTS = _BENCHES.parent / "docs" / "quality" / "results.json"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _BENCHES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


quality = _load("quality")
tasks = sys.modules["quality_tasks"]
rep = sys.modules["quality_report"]


def _tiny(seed: int = 5, steps: int = 40) -> object:
    task = tasks.make_task("synthetic", seed, quick=True, steps=steps, eval_samples=1024)
    config = replace(task.config, table_rows=(300, 100, 40), dim=8, batch_size=64)
    data = tasks._Memo(tasks.SyntheticCTR(config))
    return replace(task, config=config, train=data, eval=data.eval_batches(8))


def test_exact_restores_are_bit_identical_and_lossy_ones_are_not(tmp_path):
    with deterministic():
        out = quality.run_seed(_tiny(), schemes=("exact", "int4", "int2"), restores=(1, 4),
                               workdir=tmp_path)
    by = {(r["scheme"], r["restores"]): r for r in out["runs"]}
    for n in (1, 4):
        assert by[("exact", n)]["identical"]
        assert (by[("exact", n)]["loss"], by[("exact", n)]["auc"]) == (out["loss"], out["auc"])
        assert not by[("int2", n)]["identical"] and by[("int2", n)]["loss"] != out["loss"]
        # Fewer bits, fewer bytes: the restores really went through the scheme.
        assert by[("int2", n)]["bytes"] < by[("int4", n)]["bytes"] < by[("exact", n)]["bytes"]
    assert list(tmp_path.iterdir()) == []  # every run's store is removed


class _Shuffled:
    """Training data whose batch changes with every call: the pairing is broken."""

    def __init__(self, data) -> None:
        self.data, self.calls = data, 0

    def batch(self, step: int):
        self.calls += 1
        return self.data.batch(step + self.calls)


def test_a_broken_pairing_stops_the_experiment(tmp_path):
    task = _tiny()
    task = replace(task, train=_Shuffled(task.train))
    with deterministic(), pytest.raises(quality.PairingBroken, match="exact restores"):
        quality.run_seed(task, schemes=("exact",), restores=(2,), workdir=tmp_path)


def test_restore_points_are_distinct_and_inside_the_run():
    assert quality.restore_points(1, 100) == [50]
    points = quality.restore_points(20, 300)
    assert len(set(points)) == 20 and points == sorted(points) and 0 < points[0]
    assert points[-1] < 300
    with pytest.raises(ValueError):
        quality.restore_points(20, 10)


def test_t_quantiles_and_intervals():
    for df, exact in ((2, 4.302653), (5, 2.570582), (10, 2.228139), (23, 2.068658),
                      (100, 1.983972)):
        assert rep.t975(df) == pytest.approx(exact, abs=2e-3), df
    mean, half = rep.interval([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and half == pytest.approx(3.182446 * math.sqrt(5 / 3) / 2, rel=1e-3)
    assert rep.interval([0.0, 0.0, 0.0]) == (0.0, 0.0)


def _doc(changes: dict[tuple[str, int], tuple[float, float]], *, spread=1e-6) -> dict:
    """A results document with two tasks; each (scheme, restores) gets a relative loss and
    AUC change per seed of the given mean, +-spread."""
    nbytes = {"exact": 400, "fp16": 200, "int8": 100, "int4": 60, "int2": 40}
    seeds = []
    for k in range(6):
        wiggle = spread * (1 if k % 2 else -1)
        runs = [{"scheme": s, "restores": n, "loss": 0.5 * (1 + dl + wiggle),
                 "auc": 0.8 * (1 + da - wiggle), "bytes": nbytes[s], "identical": s == "exact"}
                for (s, n), (dl, da) in changes.items()]
        seeds.append({"seed": k, "loss": 0.5, "auc": 0.8, "runs": runs})
    schemes = list(dict.fromkeys(s for s, _ in changes))
    restores = sorted({n for _, n in changes})
    task = {"steps": 1, "eval_samples": 1, "batch": 1, "dim": 1, "table_rows": [1],
            "seeds": seeds}
    return {"schemes": schemes, "restores": restores, "quick": False,
            "tasks": {"a": task, "b": task}}


def test_budget_judges_the_worse_end_of_both_intervals():
    doc = _doc({("exact", 1): (0, 0), ("int8", 1): (5e-5, -5e-5), ("int4", 1): (9.95e-5, 0),
                ("int2", 1): (0, -2e-4)})
    c = rep.cells(doc["tasks"]["a"])
    assert c[("exact", 1)]["within"] and c[("exact", 1)]["identical"]
    assert c[("int8", 1)]["within"]
    assert c[("int4", 1)]["loss"][0] < 1e-4 and not c[("int4", 1)]["within"]  # upper end out
    assert not c[("int2", 1)]["within"]                                         # AUC fell
    assert c[("int8", 1)]["loss"][0] == pytest.approx(5e-5)
    assert c[("int8", 1)]["auc"][0] == pytest.approx(-5e-5)


def test_policy_takes_the_cheapest_scheme_within_budget_up_to_each_count():
    ok, bad = (1e-5, -1e-5), (5e-4, -5e-4)
    doc = _doc({("exact", 1): (0, 0), ("exact", 5): (0, 0), ("exact", 20): (0, 0),
                ("int8", 1): ok, ("int8", 5): ok, ("int8", 20): bad,
                ("int4", 1): ok, ("int4", 5): bad, ("int4", 20): bad,
                ("int2", 1): bad, ("int2", 5): bad, ("int2", 20): bad})
    assert rep.derive_policy(doc) == [(1, "int4"), (5, "int8"), (20, "exact")]
    # A scheme that fails at a smaller count is not trusted at a larger one.
    doc = _doc({("exact", 1): (0, 0), ("exact", 5): (0, 0), ("int4", 1): bad,
                ("int4", 5): ok})
    assert rep.derive_policy(doc) == [(5, "exact")]


def test_merge_joins_the_runs_of_a_seed_and_refuses_a_different_setup():
    one = _doc({("exact", 1): (0, 0), ("int8", 1): (1e-5, -1e-5)})
    more = _doc({("exact", 1): (0, 0), ("int2", 1): (5e-4, -5e-4), ("int2", 5): (9e-4, 0)})
    merged = quality.merge([one, more])
    assert merged["schemes"] == ["exact", "int8", "int2"] and merged["restores"] == [1, 5]
    c = rep.cells(merged["tasks"]["a"])
    assert set(c) == {("exact", 1), ("int8", 1), ("int2", 1), ("int2", 5)}
    assert all(x["n"] == 6 for x in c.values())
    assert rep.derive_policy(merged) == [(1, "int8"), (5, "exact")]  # int8 unmeasured at 5
    changed = _doc({("exact", 1): (0, 0), ("int8", 1): (2e-5, -1e-5)})
    with pytest.raises(ValueError, match="differs"):
        quality.merge([one, changed])
    other = json.loads(json.dumps(more))
    other["tasks"]["a"]["seeds"][0]["loss"] = 0.4  # not the same base run
    with pytest.raises(ValueError, match="base runs differ"):
        quality.merge([one, other])
    other = json.loads(json.dumps(more))
    other["tasks"]["a"]["steps"] = 2
    with pytest.raises(ValueError, match="setup"):
        quality.merge([one, other])


@pytest.mark.slow
def test_seeds_in_worker_processes_give_the_same_results(tmp_path):
    kw = {"seeds": 2, "schemes": ("exact", "int4"), "restores": (2,), "quick": True,
          "log": lambda s: None}
    alone = quality.experiment(["synthetic"], jobs=1, **kw)
    workers = quality.experiment(["synthetic"], jobs=2, out=tmp_path, **kw)
    assert json.loads((tmp_path / "results.json").read_text())["tasks"] == workers["tasks"]
    for doc in (alone, workers):
        for seed in doc["tasks"]["synthetic"]["seeds"]:
            seed.pop("seconds")
            for run in seed["runs"]:
                assert run.pop("bytes") > 0  # the store's metadata: a few bytes vary
    assert alone == workers == quality.merge([alone, workers])


def test_movielens_is_read_as_a_ctr_task():
    sparse, dense, labels = tasks._movielens_arrays()
    assert len(labels) == 100_000 and dense.shape == (100_000, 21)
    assert [int(c.max()) + 1 for c in sparse[:2]] == [943, 1682]
    assert all(int(c.min()) == 0 for c in sparse)
    # 34,174 ratings of 4 and 21,201 of 5 among the 100,000.
    assert int(labels.sum()) == 55_375
    task = tasks.make_task("movielens", 3, quick=True)
    assert task.eval_samples == 20_000 and task.config.table_rows[:2] == (943, 1682)
    first = task.train.batch(0)
    assert first.ids[0].shape == (task.config.batch_size, 1)
    again = tasks.make_task("movielens", 3, quick=True).train.batch(0)
    assert torch.equal(first.ids[1], again.ids[1]) and torch.equal(first.labels, again.labels)
    other = tasks.make_task("movielens", 4, quick=True).train.batch(0)
    assert not torch.equal(first.ids[1], other.ids[1])


def test_quick_mode_writes_results_tables_and_plots(tmp_path):
    assert quality.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert set(doc["tasks"]) == {"synthetic", "movielens"} and doc["quick"]
    for task in doc["tasks"].values():
        c = rep.cells(task)
        for n in doc["restores"]:
            assert c[("exact", n)]["identical"] and c[("exact", n)]["loss"] == (0.0, 0.0)
            assert c[("int2", n)]["bytes"] < c[("int8", n)]["bytes"] < c[("exact", n)]["bytes"]
    for png in ("quality_restores.png", "quality_bytes.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| exact | 1 |" in (tmp_path / "report.md").read_text()


def test_auto_rule_is_the_one_the_committed_measurement_supports():
    doc = json.loads(_RESULTS.read_text())
    assert not doc["quick"] and set(doc["tasks"]) == {"synthetic", "movielens"}
    policy = rep.derive_policy(doc)
    assert [(float(n), s) for n, s in policy if s != "exact"] == list(autopolicy.AUTO_POLICY)
    for n, scheme in policy:
        assert auto_scheme(n) == scheme
    assert auto_scheme(max(doc["restores"]) + 1) == autopolicy.AUTO_BEYOND


def test_auto_rule_is_monotone_and_checks_its_input():
    order = {"int2": 2, "int3": 3, "int4": 4, "int8": 8, "fp16": 16, "bf16": 16, "exact": 32}
    picks = [auto_scheme(r) for r in (0, 0.5, 1, 1.5, 2, 5, 6, 19, 20, 21, 1000)]
    assert [order[p] for p in picks] == sorted(order[p] for p in picks)
    ends = [most for most, _ in autopolicy.AUTO_POLICY]
    assert ends == sorted(ends)
    for most, scheme in autopolicy.AUTO_POLICY:
        assert auto_scheme(most) == scheme
    for bad in (-1, math.nan, math.inf):
        with pytest.raises(ValueError):
            auto_scheme(bad)
    with pytest.raises(TypeError):
        auto_scheme("3")

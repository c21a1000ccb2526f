"""The quality experiment (benches/quality.py): exact restores change nothing, lossy ones
change a little, and the experiment's bookkeeping is right."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cnrstore.demo.dlrm import DLRMConfig

_PATH = Path(__file__).resolve().parents[1] / "benches" / "quality.py"
_spec = importlib.util.spec_from_file_location("bench_quality", _PATH)
quality = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = quality  # dataclasses look their module up while decorating
_spec.loader.exec_module(quality)

TINY = DLRMConfig(table_rows=(400, 200, 50), dim=8, batch_size=128, seed=5)


def _case(tmp_path, scheme, failures, *, steps=60, every=10, config=TINY, device="cpu"):
    return quality.run_case(config, steps=steps, every=every, failures=failures,
                            scheme=scheme, workdir=tmp_path / f"{scheme}-{len(failures)}",
                            n_eval=4, keep_tables=True, device=device)


def test_exact_restores_reproduce_the_uninterrupted_run_bit_for_bit(tmp_path):
    base, base_tables = _case(tmp_path, "exact", [])
    points = quality.failure_points(3, steps=60, every=10)
    run, tables = _case(tmp_path, "exact", points)
    assert tables.keys() == base_tables.keys()
    for name in tables:
        assert torch.equal(tables[name], base_tables[name]), name
    assert (run.loss, run.auc) == (base.loss, base.auc)
    assert run.mean_bytes > 0
    lossy, lossy_tables = _case(tmp_path, "int4", points)
    # The restores really went through int4: embeddings differ, yet training is unharmed.
    assert not torch.equal(lossy_tables["model/embs.0.weight"], base_tables["model/embs.0.weight"])
    assert lossy.resolved == "int4"
    assert abs(lossy.loss_rel(base)) < 0.05 and abs(lossy.auc_rel(base)) < 0.05
    assert lossy.mean_bytes < run.mean_bytes


def test_failure_points_are_distinct_and_off_checkpoints():
    points = quality.failure_points(20, steps=1000, every=25)
    assert len(set(points)) == 20 and points == sorted(points)
    assert all(0 < p < 1000 and p % 25 for p in points)
    assert quality.failure_points(0, steps=10, every=5) == []
    with pytest.raises(ValueError):
        quality.failure_points(20, steps=10, every=5)


def test_budget_judges_relative_loss_and_auc():
    base = quality.Outcome("exact", "exact", 0, 0.5, 0.8, 0.0, 0.0)
    near = quality.Outcome("int8", "int8", 1, 0.50001, 0.79999, 0.0, 0.0)
    far = quality.Outcome("int2", "int2", 1, 0.501, 0.8, 0.0, 0.0)
    better = quality.Outcome("int4", "int4", 1, 0.49, 0.81, 0.0, 0.0)
    assert near.within(base) and better.within(base) and not far.within(base)
    table = quality.markdown([(base, [near, far])], {"steps": 1})
    assert "| int8 |" in table and "✗" in table.split("| int2 |")[1]
    assert "✗" not in table.split("| int8 |")[1].split("\n")[0]
    # Averaged over seeds: one bad seed out of two still fails the budget.
    table = quality.markdown([(base, [near]), (base, [replace(far, scheme="int8")])], {})
    assert "✗" in table.split("| int8 |")[1]


@pytest.mark.slow
def test_every_scheme_after_five_restores(tmp_path):
    config = DLRMConfig(seed=1).scaled(0.02)
    base, outcomes = quality.experiment(config, steps=300, every=20, restores=(5,),
                                        n_eval=16)
    by = {o.scheme: o for o in outcomes}
    assert (by["exact"].loss, by["exact"].auc) == (base.loss, base.auc)
    for scheme in ("fp16", "int8"):
        assert abs(by[scheme].loss_rel(base)) < 0.01, scheme
    for o in outcomes:
        assert abs(o.loss_rel(base)) < 0.1, o


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_exact_restores_are_bit_identical_on_cuda(tmp_path):
    base, base_tables = _case(tmp_path, "exact", [], device="cuda")
    run, tables = _case(tmp_path, "exact", quality.failure_points(2, steps=60, every=10),
                        device="cuda")
    for name in tables:
        assert torch.equal(tables[name], base_tables[name]), name
    assert (run.loss, run.auc) == (base.loss, base.auc)

"""The long-run benchmark (benches/bench_longrun.py) at a tiny scale: its JSON holds every
figure per setting, the figures are sane, and the plot is drawn from it."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import bench_longrun  # noqa: E402


def test_quick_run_reports_write_and_restore_read_and_plots(tmp_path):
    out = tmp_path / "out"
    argv = ["--quick", "--fractions", "0.05", "--out", str(out), "--label", "t"]
    assert bench_longrun.main(argv) == 0
    doc = json.loads((out / "bench_longrun.json").read_text())
    assert [(r["workload"], r["quant"]) for r in doc["results"]] == [
        ("zipf-5pct", "exact"), ("zipf-5pct", "int8")]
    for r in doc["results"]:
        assert len(r["step_bytes"]) == len(r["raw_bytes"]) == r["steps"] == 12
        assert len(r["restore_read"]) == 13
        assert all(b > 0 for b in r["raw_bytes"])
        assert r["amortized"] == pytest.approx(sum(r["step_bytes"]) / sum(r["raw_bytes"]))
        med = statistics.median(r["step_bytes"])
        assert r["max_over_median"] == pytest.approx(max(r["step_bytes"]) / med)
        assert r["max_restore_read"] == max(r["restore_read"]) < 2.5
        assert r["max_chain"] == 64
        if r["quant"] == "exact":  # rows stored raw: step 0 (the full put) reads the table
            assert r["row_nbytes"] == 256 and r["restore_read"][0] == pytest.approx(1, 0.02)
            assert min(r["restore_read"][1:]) >= r["restore_read"][0]
        else:  # 64 codes and the row's scale and offset
            assert 64 < r["row_nbytes"] < 256
    assert "| t | zipf-5pct | exact | 64 |" in (out / "bench_longrun.md").read_text()
    assert not list(out.glob("store-*"))  # the stores are removed
    png = tmp_path / "p.png"
    assert bench_longrun.main(["--out", str(out), "--plot", str(png),
                               str(out / "bench_longrun.json")]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--rows", "1", "--tables", "2"],
                                  ["--plot", "x.png"]])
def test_bad_arguments_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit):
        bench_longrun.parse_args(["--out", str(tmp_path), *argv])


def test_budget_setting_reaches_the_policy_and_is_restored(tmp_path):
    """--budget runs each setting under its own chain budget range (a tighter one holds
    restores lower), reports the last-45 figures, and leaves the policy's range as it was."""
    from cnrstore.core import chainpolicy

    out = tmp_path / "out"
    argv = ["--quick", "--fractions", "0.05", "--quant", "exact", "--budget", "0.2:0.3",
            "0.5:1", "--out", str(out)]
    assert bench_longrun.main(argv) == 0
    assert chainpolicy.BUDGET_RANGE == (0.5, 1.0)
    tight, wide = json.loads((out / "bench_longrun.json").read_text())["results"]
    assert (tight["budget"], wide["budget"]) == ([0.2, 0.3], [0.5, 1.0])
    assert tight["max_restore_read"] < wide["max_restore_read"]
    assert tight["amortized"] > wide["amortized"]
    k = min(45, tight["steps"])
    assert tight["amortized_last45"] == pytest.approx(
        sum(tight["step_bytes"][-k:]) / sum(tight["raw_bytes"][-k:]))
    assert "| 0.2:0.3 | 12 |" in (out / "bench_longrun.md").read_text()


@pytest.mark.parametrize("budget", ["1", "0.6:0.3", "a:b", "0:1"])
def test_bad_budget_is_refused(budget, tmp_path):
    with pytest.raises(SystemExit):
        bench_longrun.parse_args(["--out", str(tmp_path), "--budget", budget])


@pytest.mark.slow  # ~20 s: the bounds search every rewrite period
def test_model_prints_its_bounds(capsys):
    """benches/model_longrun.py: the per-row bound is below the block family's, both above
    the floor (1x), and the replayed policy reports every figure."""
    from benches import model_longrun

    assert model_longrun.main(["--steps", "3", "--fractions", "0.05"]) == 0
    lines = capsys.readouterr().out.splitlines()
    fam = next(x for x in lines if "full block + merged patch" in x)
    rate = next(x for x in lines if "grouped by rate" in x)
    value = lambda line: float(line.split("write >= ")[1].split("x")[0])  # noqa: E731
    assert 1.0 < value(rate) < value(fam)
    assert any("policy budget 0.5:1" in x and "max restore read" in x for x in lines)


def _model_rows(steps: int) -> list:
    """Rows changing at Zipf-like rates min(1, 2000 / rank), ranks scattered over the
    table (~2.5% a step)."""
    import numpy as np

    from benches import model_longrun

    rng = np.random.default_rng(0)
    p = rng.permutation(np.minimum(1.0, 2000.0 / np.arange(1, model_longrun.ROWS + 1)))
    return [[np.flatnonzero(rng.random(len(p)) < p) for _ in range(steps)]
            for _ in range(model_longrun.TABLES)]


def test_hot_policy_without_hot_rows_is_the_policy():
    """With no row ever hot, the hot-patch replay writes and reads what the policy does:
    the two replays share budgets, depth caps and merge rule."""
    from benches import model_longrun

    rows = _model_rows(8)
    plain = model_longrun.policy(rows, 0.05, (0.1, 0.2), 0.5)
    hot = model_longrun.hot_policy(rows, (0.1, 0.2), 0.5, 0.2, 2.0, 2.0)
    assert {k: hot[k] for k in plain} == plain
    assert hot["objects"] == 1.0
    some = model_longrun.hot_policy(rows, (0.1, 0.2), 0.5, 0.5, 0.5, 0.3)
    assert 1.0 < some["objects"] <= 2.0 and some["depth"] >= 2


@pytest.mark.slow  # ~30 s
def test_collapse_bound_lies_between_the_others():
    """Any chain on whole-block bases needs at least the collapse bound: above the bound
    of rows grouped by rate (which has no whole-block base), below the block family's."""
    from benches import model_longrun

    w, _, r = model_longrun.collapse_bound(0.05)
    assert r <= 0.5
    assert 1 + model_longrun.bound(0.05)[0] < w < 1 + model_longrun.family(0.05)[0]


@pytest.mark.parametrize("layout", ["chains", "grouped"])
def test_time_puts_reports_stalls_against_torch_save_both_ways(tmp_path, layout):
    """--time-puts: every incremental put non-blocking with the touched rows, its stall
    and put timed, torch.save + fsync timed both ways every --peer-every steps; the objects
    are those of blocking puts (the same changed rows, the same bytes read by each step's
    restore), and nothing is left on disk."""
    out = tmp_path / "out"
    base = ["--quick", "--fractions", "0.05", "--quant", "int8", "--layout", layout]
    assert bench_longrun.main([*base, "--out", str(out), "--time-puts",
                               "--peer-every", "4"]) == 0
    r = json.loads((out / "bench_longrun.json").read_text())["results"][0]
    assert len(r["stall_s"]) == len(r["put_s"]) == 12
    assert all(0 < s <= p for s, p in zip(r["stall_s"], r["put_s"]))
    assert [p["step"] for p in r["torch_save"]] == [4, 8, 12]
    for p in r["torch_save"]:
        assert p["peer_s"] == min(p["keep_s"], p["replace_s"]) > 0
    assert r["peer_s"] == statistics.median(p["peer_s"] for p in r["torch_save"])
    assert r["stall_mean_last45_x"] == pytest.approx(
        statistics.fmean(r["stall_s"]) / r["peer_s"])
    assert r["stall_max_last45_x"] == pytest.approx(max(r["stall_s"]) / r["peer_s"])
    assert "x of " in (out / "bench_longrun.md").read_text()
    assert not [p for p in out.iterdir() if p.is_dir()]  # stores and the peer's files gone
    plain = tmp_path / "plain"
    assert bench_longrun.main([*base, "--out", str(plain)]) == 0
    q = json.loads((plain / "bench_longrun.json").read_text())["results"][0]
    assert "stall_s" not in q
    for key in ("raw_bytes", "restore_read", "closure"):
        assert q[key] == r[key], key

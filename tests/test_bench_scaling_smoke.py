"""The scaling benchmark (benches/bench_scaling.py) at a tiny scale: every sweep reports
every operation at every point, the figures are sane, slopes are derived from them, and
the plot is drawn from the JSON."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import bench_scaling  # noqa: E402


def test_quick_run_reports_every_operation_and_plots(tmp_path):
    out = tmp_path / "out"
    assert bench_scaling.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads((out / "bench_scaling.json").read_text())
    assert list(doc["sweeps"]) == ["size", "steps", "tables"]
    assert [r["x"] for r in doc["sweeps"]["steps"]] == [1, 4, 12]
    assert [r["x"] for r in doc["sweeps"]["tables"]] == [1, 4, 12]
    for sweep, rows in doc["sweeps"].items():
        for r in rows:
            assert set(bench_scaling.OPS) <= set(r), (sweep, r)
            assert all(r[op] > 0 for op in bench_scaling.OPS), (sweep, r)
        assert set(doc["slopes"][sweep]) == set(bench_scaling.OPS)
        a, b = rows[-2], rows[-1]
        assert doc["slopes"][sweep]["disk"] == pytest.approx(
            math.log(b["disk"] / a["disk"]) / math.log(b["x"] / a["x"]))
    sizes = doc["sweeps"]["size"]
    assert sizes[1]["disk"] > 2 * sizes[0]["disk"]  # four times the table, stored
    kept = doc["sweeps"]["steps"]
    assert kept[-1]["disk"] > kept[0]["disk"]  # the kept steps' patches take room
    md = (out / "bench_scaling.md").read_text()
    assert "### steps (steps kept)" in md and "| slope |" in md
    assert not list(out.glob("store-*"))  # the stores are removed
    png = tmp_path / "p.png"
    assert bench_scaling.main(["--out", str(out), "--plot", str(png),
                               str(out / "bench_scaling.json")]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cost_growing_faster_than_its_work_is_flagged():
    assert bench_scaling.too_fast("steps", "open", 0.5)  # open should not grow with steps
    assert not bench_scaling.too_fast("steps", "verify", 1.0)  # linear in what is kept
    assert bench_scaling.too_fast("tables", "put_full", 1.6)
    rows = [{"x": 10, **dict.fromkeys(bench_scaling.OPS, 1.0)},
            {"x": 100, **dict.fromkeys(bench_scaling.OPS, 100.0)}]
    assert bench_scaling.slopes("tables", rows)["gc"] == pytest.approx(2.0)
    assert "**!**" in bench_scaling.markdown({"sweeps": {"tables": rows},
                                              "slopes": {"tables": bench_scaling.slopes(
                                                  "tables", rows)}})


@pytest.mark.parametrize("argv", [["--kept", "0"], ["--sizes", "0"], ["--fraction", "2"],
                                  ["--plot", "x.png"]])
def test_bad_arguments_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit):
        bench_scaling.parse_args(["--out", str(tmp_path), *argv])

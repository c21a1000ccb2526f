"""benches/bench_grouped_read.py at a tiny scale: it builds both layouts' stores, restores
the last step of each (which must agree), and prints one JSON line a run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import bench_grouped_read  # noqa: E402


def test_tiny_build_and_time_report_both_layouts(tmp_path, capsys):
    bench_grouped_read.main(["--build", "--time", "--dir", str(tmp_path), "--rows", "4000",
                             "--steps", "6", "--fraction", "0.05", "--runs", "2",
                             "--block-rows", "256"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()
             if x.startswith("{")]
    assert [r["run"] for r in lines] == [0, 1]
    for r in lines:
        for key in ("grouped_warm_s", "grouped_cold_s", "chains_warm_s", "chains_cold_s"):
            assert r[key] > 0
        gw, cw = r["grouped_warm_s"], r["chains_warm_s"]
        # the times are printed to 0.1 ms, the ratio from the unrounded ones: tiny runs
        # take a few ms, so the rounding alone moves gw / cw by up to 5e-5 / each time
        slack = gw / cw * 5e-5 * (1 / gw + 1 / cw) + 5e-4
        assert abs(r["warm_ratio"] - gw / cw) <= slack
    assert json.loads((tmp_path / "grouped.json").read_text())["step"] == 6

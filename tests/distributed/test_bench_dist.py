"""benches/bench_dist.py end to end at a tiny size (slow: it spawns ranks five times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_run_reports_every_system(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "benches", "bench_dist.py"),
                           "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    systems = report["systems"]
    assert set(systems) == {"cnr", "dcp", "dcp_async"}
    for r in systems.values():
        assert r["restore_exact"] and len(r["steps"]) == 2
        assert r["restore_inplace_s"] > 0  # cnr: into existing Shards, as dcp.load does
    assert systems["dcp"]["restore_inplace_s"] == systems["dcp"]["restore_s"]
    # the incremental step: cnrstore writes a fraction of what DCP writes again
    assert systems["cnr"]["steps"][1]["bytes"] < systems["dcp"]["steps"][1]["bytes"] / 4
    assert "| cnr |" in (tmp_path / "results.md").read_text()

"""benches/bench_dcp.py end to end at a tiny size (slow: it spawns ranks six times)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_run_reports_every_system(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "benches", "bench_dcp.py"),
                           "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["systems"]) == {"fs", "cnr", "cnr_open"}
    for r in report["systems"].values():
        assert r["exact"] and len(r["steps"]) == 2
    # a later save through cnrstore writes a fraction of what DCP's files write again
    for name in ("cnr", "cnr_open"):
        assert report["ratios"][name]["later_bytes"] < 0.25, report["ratios"]
    assert "| cnr_open |" in (tmp_path / "results.md").read_text()

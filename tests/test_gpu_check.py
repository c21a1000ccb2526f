"""benches/gpu_check.sh on a machine without a GPU (issue 27): it says so, writes its one
JSON file, and exits 0; on a GPU machine this test is skipped (the script runs for real)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the check itself")
def test_gpu_check_says_there_is_no_gpu_and_exits_0(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(REPO / "benches" / "gpu_check.sh"), str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["gpu"] is False and doc["ok"] is True
    assert doc["probe"]["executable"] == sys.executable
    assert doc["probe"]["missing_modules"] == []
    assert doc["probe"]["native_kernel"]["state"] in ("loaded", "unavailable")

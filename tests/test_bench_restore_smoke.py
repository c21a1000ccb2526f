"""The restore benchmark (benches/bench_restore.py) at a tiny scale: every target's ratio
is in its JSON, computed from the times measured in the same repeat, and the exact
restores it times were checked bit for bit inside it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import bench_restore  # noqa: E402


def test_tiny_run_reports_every_target_from_its_own_repeat(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--scale", "0.002", "--steps", "1", "--repeat", "1", "--workdir", str(tmp_path),
            "--out", str(out)]
    assert bench_restore.main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc["targets"]) == set(bench_restore.TARGETS)
    run = doc["runs"][0]
    assert run["cold_int8_over_torch_load"] == run["cold_int8_s"] / run["cold_torch_load_s"]
    assert run["cold_exact_over_disk_time"] == run["cold_exact_s"] / run["disk_read_s"]
    assert run["load_state_over_torch"] == (run["state_load_state_s"]
                                            / run["state_torch_resume_s"])
    # int8 reads about a quarter of the exact bytes (where the page cache lets it count)
    if run["cold_exact_bytes"] > 0:
        assert run["cold_int8_bytes"] < run["cold_exact_bytes"]
    assert all(t["median"] > 0 for t in doc["targets"].values())


def test_restore_io_tiny_run_reports_each_read_and_its_requests(tmp_path, capsys):
    from benches import restore_io

    argv = ["--scale", "0.002", "--steps", "1", "--repeat", "2", "--workdir", str(tmp_path)]
    assert restore_io.main(argv) == 0
    out = capsys.readouterr().out
    for name in ("disk ", "get_tables ", "torch_load ", "get_tables / disk: median"):
        assert name in out
    assert "requests=" in out and "ms_reading=" in out

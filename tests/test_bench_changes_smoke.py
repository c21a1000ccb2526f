"""The changes benchmark (benches/bench_changes.py) at a tiny scale: its JSON holds every
figure, changes find exactly the rows two full restores find, and read a fraction of
what a restore reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import bench_changes  # noqa: E402


def test_quick_run_reports_changes_against_restores(tmp_path, capsys):
    assert bench_changes.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_changes.json").read_text())
    assert "| zipf-1pct |" in (tmp_path / "bench_changes.md").read_text()
    assert [r["workload"] for r in doc["results"]] == ["zipf-1pct", "zipf-5pct"]
    for r in doc["results"]:
        assert r["get_tables_s"] > 0 and r["get_tables_bytes"] > 0
        for label in ("one_step", "3_steps"):
            c = r[label]
            assert c["rows"] > 0 and c["rows"] == c["compare_restores_rows"], (r, label)
            assert 0 < c["bytes_read"] < r["get_tables_bytes"] / 4, c
            assert c["seconds"] > 0 and c["compare_restores_s"] > 0
        assert r["3_steps"]["rows"] > r["one_step"]["rows"]
    assert not list(tmp_path.glob("store-*"))  # the stores are removed


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--span", "5", "--steps", "3"]])
def test_bad_arguments_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit):
        bench_changes.parse_args(["--out", str(tmp_path), *argv])

"""``get_tables(out=)`` restores without a second copy of the table (issue 10): its peak RSS
grows by bounded per-block buffers, not by the table, measured in a fresh process with
benches/bench_inplace.py (which also runs the plain get_tables as the control)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benches.bench_inplace import prepare, run_worker  # noqa: E402


def _check(tmp_path, mib: int, threads: int) -> None:
    width = 128
    rows = mib * (1 << 20) // (4 * width)
    prepare(str(tmp_path), rows, width, torch_file=False)
    inplace = run_worker("get_tables_out", str(tmp_path), rows, width, threads)
    control = run_worker("get_tables", str(tmp_path), rows, width, threads)
    assert control["growth_over_table"] > 0.9, control  # the measurement sees a copy
    assert inplace["growth_over_table"] < 0.25, inplace


def test_in_place_restore_does_not_copy_the_table(tmp_path):
    _check(tmp_path, 128, threads=2)


@pytest.mark.slow
def test_in_place_restore_of_a_400_mb_table(tmp_path):
    _check(tmp_path, 400, threads=8)

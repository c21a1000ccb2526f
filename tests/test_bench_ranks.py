"""The many-rank benches' rank plumbing (benches/bench_dist.py ``spawn``, which
bench_dcp and bench_torchrec run their ranks through): a rank's result counts once it is
written, whatever its interpreter's teardown does; a rank's error reaches the caller with
its message; a rank that dies before its result is reported with its exit code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import bench_torchrec  # noqa: E402


def test_a_rank_aborting_in_its_teardown_does_not_fail_a_finished_run():
    # Before, bench_torchrec's ranks left through the interpreter's teardown: an abort
    # there (exit -6) failed the whole bench after every result was written.
    got = bench_torchrec.spawn(1, "_rank_programs:teardown_aborts", 7, timeout=300)
    assert got == [{"rank": 0, "world": 1, "value": 7}]


@pytest.mark.slow
def test_a_ranks_error_reaches_the_caller_with_its_message():
    with pytest.raises(RuntimeError, match="rank 0 of 1 refuses"):
        bench_torchrec.spawn(1, "_rank_programs:raises", timeout=300)


@pytest.mark.slow
def test_a_rank_that_dies_before_its_result_is_reported_with_its_exit_code():
    with pytest.raises(RuntimeError, match=r"left no result \(exit codes \[3\]\)"):
        bench_torchrec.spawn(1, "_rank_programs:dies", timeout=300)

"""A blocking distributed put writes the runs a rank's own piece holds whole from the
caller's tensor, with no staging copy (docs/design/put-path.md, "A blocking put borrows
the table"); the step holds the values at call time on every rank, or no rank commits
it, even when one rank's caller stops waiting and changes its table."""

from __future__ import annotations

import pytest
from borrow_workers import interrupted, staged
from dist_util import BLOCK_ROWS, Failed, run


@pytest.mark.parametrize("world", [2, 3, 4])
def test_blocking_put_stages_no_copy_of_whole_runs(tmp_path, world):
    res = run(world, staged, str(tmp_path / "s"))
    block = BLOCK_ROWS * 8 * 4
    for rank, got in enumerate(res):
        assert not isinstance(got, Failed), got.trace
        after_blocking, after_nonblocking, piece, ok1, ok2 = got
        assert ok1 and ok2, rank
        # Only a boundary block and the rows moved went through the host buffers (three
        # blocks' worth at most), not the rank's piece, which is 7 blocks or more...
        assert after_blocking <= 3 * block < piece - 3 * block, (rank, after_blocking, piece)
        # ...where a non-blocking put copies what it writes, so the pool holds that.
        assert after_nonblocking >= piece - 2 * block, (rank, after_nonblocking, piece)


def test_a_rank_interrupted_in_a_blocking_put_fails_the_step_everywhere(tmp_path):
    res = run(2, interrupted, str(tmp_path / "s"))
    for got in res:
        assert not isinstance(got, Failed), got.trace
    (raised0, steps0, ok0, end0), (raised1, steps1, ok1, end1) = res
    assert raised0 == "KeyboardInterrupt"
    assert raised1 is not None and raised1.startswith("WriteFailed") \
        and "stopped waiting" in raised1, raised1
    assert steps0 == steps1 == []  # step 1 would hold rank 0's overwritten rows
    assert ok0 and ok1 and end0 == end1 == [2]

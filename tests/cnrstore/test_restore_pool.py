"""run_all (cnrstore/core/restore.py), how a restore runs its blocks on the decode pool:
every block once; on failure the error of the lowest failing block, raised only after
every block that began has ended (they write into the caller's tensor), and the blocks
not begun dropped."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.core.restore import run_all


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 40), workers=st.integers(1, 3))
def test_every_item_runs_once(n, workers):
    seen: list[int] = []
    lock = threading.Lock()

    def fn(i):
        with lock:
            seen.append(i)

    with ThreadPoolExecutor(workers) as pool:
        run_all(pool, fn, range(n))
    assert sorted(seen) == list(range(n))


def test_the_lowest_failure_is_raised_after_the_running_blocks_end():
    ended: list[int] = []
    first_failed = threading.Event()

    def fn(i):
        if i == 3:  # fails first in time
            first_failed.set()
            raise ValueError("block 3")
        if i == 2:  # running when 3 fails, fails later: its error is the one raised
            first_failed.wait(5)
            time.sleep(0.1)
            ended.append(i)
            raise KeyError("block 2")
        if i < 2:
            ended.append(i)
            return
        time.sleep(0.05)
        ended.append(i)

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(KeyError, match="block 2"):
            run_all(pool, fn, range(50))
        assert 2 in ended  # it had ended before run_all raised
        late = len(ended)
        time.sleep(0.3)
        assert len(ended) == late  # nothing ran after it returned
    assert len(ended) < 20  # the blocks not begun were dropped

"""A put that fails changes no later id (docs/ARCHITECTURE.md, "Determinism"; docs/MANIFEST.md,
"Failed background put"): after it, the handle's tracker-driven puts store every table
under the ids a handle that never tried it stores, whatever the scheme and whether bases
are seeded from the store, and the stored rows are right even though the caller's
tracker was consumed by the failed put.

The background writer fails for real: the test holds the engine's writer lock (as another
process's writer would) past ``lock_timeout``.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from ckpt_util import tracked_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cnrstore

OPTS = {"block_rows": 32, "fanout": 4}


def _steps(delta: float, n: int = 7) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return tracked_run(delta, n, seed=11, width=8)


def _never_failed(path, run, skip: set[int], quant: str, seed: bool) -> dict[int, dict]:
    """The ids of a handle that puts every step but ``skip``, its touched rows covering
    every change since its last put."""
    ids = {}
    with cnrstore.open(path, seed_from_store=seed, **OPTS) as s:
        ids[0] = s.put_tables(0, {"t": run[0][0]}, quant=quant).tables
        since: list[torch.Tensor] = []
        for step, (t, touched) in enumerate(run[1:], start=1):
            assert touched is not None
            since.append(touched)
            if step in skip:
                continue
            fut = s.put_tables(step, {"t": t}, quant=quant, blocking=False,
                               touched={"t": torch.cat(since)})
            ids[step] = fut.result(timeout=60).tables
            since = []
    return ids


@pytest.mark.parametrize("quant,delta,seed", [
    ("int8", 1e-3, True),    # a seeded lossy base compares codes, the handle's own values
    ("exact", 1.0, False),   # without seeding, a dropped base wrote every block full
    ("exact", 1.0, True),
])
def test_the_puts_after_a_failed_put_store_the_ids_of_a_handle_that_never_tried_it(
        tmp_path, quant, delta, seed):
    run = _steps(delta)
    ids = {}
    with cnrstore.open(tmp_path / "s", seed_from_store=seed, lock_timeout=0.2, **OPTS) as s:
        ids[0] = s.put_tables(0, {"t": run[0][0]}, quant=quant).tables
        for step, (t, touched) in enumerate(run[1:], start=1):
            if step == 2:
                held = s.objects.writer()
                try:
                    fut = s.put_tables(step, {"t": t}, quant=quant, blocking=False,
                                       touched={"t": touched})
                    with pytest.raises(cnrstore.WriteFailed):
                        fut.result(timeout=60)
                finally:
                    held.abort()
                continue
            # The tracker was consumed by the failed put: the rows it changed are not
            # touched again, and must still be stored.
            fut = s.put_tables(step, {"t": t}, quant=quant, blocking=False,
                               touched={"t": touched})
            ids[step] = fut.result(timeout=60).tables
        assert s.steps() == [0, 1, 3, 4, 5, 6]
        got = s.get_tables(6)["t"]
        assert s.verify().ok
    assert ids == _never_failed(tmp_path / "o", run, {2}, quant, seed)
    with cnrstore.open(tmp_path / "whole", **OPTS) as o:
        o.put_tables(1, {"t": run[-1][0]}, quant=quant)
        assert torch.equal(got, o.get_tables(1)["t"])


def test_a_put_planned_after_a_failure_keeps_its_base_when_an_earlier_put_fails_later(
        tmp_path):
    # Put 2 fails; put 3 was planned on it and fails after put 4, planned once put 2's
    # failure was known, so on step 1's base: put 4's base is not one of theirs and the
    # puts after it diff against it, as a handle that never tried 2 and 3 does.
    run = _steps(1e-3)
    ids = {}
    with cnrstore.open(tmp_path / "s", lock_timeout=1.0, **OPTS) as s:
        ids[0] = s.put_tables(0, {"t": run[0][0]}, quant="int8").tables
        ids[1] = s.put_tables(1, {"t": run[1][0]}, quant="int8", blocking=False,
                              touched={"t": run[1][1]}).result(timeout=60).tables
        held = s.objects.writer()
        try:
            f2 = s.put_tables(2, {"t": run[2][0]}, quant="int8", blocking=False,
                              touched={"t": run[2][1]})
            f3 = s.put_tables(3, {"t": run[3][0]}, quant="int8", blocking=False,
                              touched={"t": run[3][1]})
            with pytest.raises(cnrstore.WriteFailed):
                f2.result(timeout=60)
            f4 = s.put_tables(4, {"t": run[4][0]}, quant="int8", blocking=False,
                              touched={"t": run[4][1]})
        finally:
            held.abort()
        with pytest.raises(cnrstore.WriteFailed):
            f3.result(timeout=60)
        ids[4] = f4.result(timeout=60).tables
        for step in (5, 6):
            ids[step] = s.put_tables(step, {"t": run[step][0]}, quant="int8", blocking=False,
                                     touched={"t": run[step][1]}).result(timeout=60).tables
        assert s.steps() == [0, 1, 4, 5, 6] and s.verify().ok
    assert ids == _never_failed(tmp_path / "o", run, {2, 3}, "int8", True)


@pytest.mark.slow
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(quant=st.sampled_from(["exact", "int8"]),
       seed=st.booleans(),
       steps=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()),
                      min_size=2, max_size=8))
def test_any_run_with_failed_puts_stores_what_a_handle_that_skipped_them_stores(
        tmp_path_factory, quant, seed, steps):
    """A property over random runs: each step (fails, tracks its rows, waited at once) puts
    the table non-blocking; a failed put is the writer's (its lock held past
    ``lock_timeout``), the caller's tracker consumed by it as by any put. Every committed
    step stores the ids that a handle putting only the committed steps, blocking and
    untracked, stores, and the newest step's rows are that handle's."""
    path = tmp_path_factory.mktemp("run")
    run = _steps(1e-3 if quant == "int8" else 1.0, n=len(steps) + 1)
    ids: dict[int, dict] = {}
    pending: dict[int, Future] = {}
    with cnrstore.open(path / "s", seed_from_store=seed, lock_timeout=0.2, **OPTS) as s:
        ids[0] = s.put_tables(0, {"t": run[0][0]}, quant=quant).tables
        for step, (fails, tracked, wait) in enumerate(steps, start=1):
            t, touched = run[step]
            kw = {"touched": {"t": touched}} if tracked else {}
            if fails:
                for k, f in pending.items():  # only this put fails: the queue first
                    ids[k] = f.result(timeout=60).tables
                pending.clear()
                held = s.objects.writer()
                try:
                    fut = s.put_tables(step, {"t": t}, quant=quant, blocking=False, **kw)
                    with pytest.raises(cnrstore.WriteFailed):
                        fut.result(timeout=60)
                finally:
                    held.abort()
                continue
            pending[step] = s.put_tables(step, {"t": t}, quant=quant, blocking=False, **kw)
            if wait:
                ids[step] = pending.pop(step).result(timeout=60).tables
        for k, f in pending.items():
            ids[k] = f.result(timeout=60).tables
        committed = sorted(ids)
        assert s.steps() == committed
        got = s.get_tables(committed[-1])["t"]
    want = {}
    with cnrstore.open(path / "o", seed_from_store=seed, **OPTS) as o:
        for step in committed:
            want[step] = o.put_tables(step, {"t": run[step][0]}, quant=quant).tables
        assert torch.equal(got, o.get_tables(committed[-1])["t"])
    assert ids == want

"""Non-blocking puts: snapshot semantics, order, back-pressure, errors on the Future.

The background writer is held up for real by holding the engine's writer lock from the test
(the same lock another process's writer would hold), never by mocks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from ckpt_util import assert_identical, make_store, random_table

import cnrstore
import engine
from cnrstore.format.load import load_manifest


def _store(**opts):
    return make_store("memory", None, block_rows=16, fanout=4, **opts)


def test_mutating_tables_after_a_non_blocking_put_does_not_change_what_is_stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    for kind in ("memory", "pack"):
        s = make_store(kind, tmp_path / "s", block_rows=16, max_inflight=4)
        t = {
            "f": random_table(g, 100, 8),
            "i": random_table(g, 64, dtype=torch.int64),
            # A cast to the table's own dtype could hand back the table itself.
            "h": random_table(g, 40, 4, dtype=torch.float16),
            "b": random_table(g, 40, 4, dtype=torch.bfloat16),
        }
        quant = {"f": "exact", "h": "fp16", "b": "bf16"}
        want, futs = [], []
        for step in range(6):
            want.append({k: v.clone() for k, v in t.items()})
            futs.append(s.put_tables(step, t, blocking=False, quant=quant))
            t["f"].mul_(1.5)[step] = -1.0  # in place, right after the put returned
            t["i"] += step
            t["h"].mul_(2.0)
            t["b"].add_(1.0)
        for f in futs:
            f.result(timeout=60)
        for step in range(6):
            got = s.get_tables(step)
            for name in t:
                assert_identical(got[name], want[step][name])
        s.close()


def test_steps_commit_in_order():
    g = torch.Generator().manual_seed(1)
    s = _store(max_inflight=3)
    t = random_table(g, 64, 4)
    done, futs = [], []
    for step in (1, 2, 5, 9):  # steps only grow (a lower one needs rollback)
        t[step] += 1
        f = s.put_tables(step, {"t": t}, blocking=False)
        f.add_done_callback(lambda f, step=step: done.append(step))
        futs.append((step, f, t.clone()))
    for step, f, want in futs:
        assert f.result(timeout=60).step == step
        assert_identical(s.get_tables(step)["t"], want)
    assert done == [1, 2, 5, 9]
    assert s.steps() == [1, 2, 5, 9]


def test_back_pressure_blocks_the_caller_while_max_inflight_puts_wait():
    g = torch.Generator().manual_seed(2)
    s = _store(max_inflight=1, lock_timeout=None)
    t = random_table(g, 32, 4)
    held = s.objects.writer()  # another writer holds the engine: nothing can commit
    first = s.put_tables(1, {"t": t}, blocking=False)
    returned = threading.Event()

    def second():
        s.put_tables(2, {"t": t}, blocking=False)
        returned.set()

    th = threading.Thread(target=second)
    th.start()
    assert not returned.wait(0.5)  # blocked: one put already in flight
    assert not first.done()
    held.abort()
    th.join(timeout=60)
    assert returned.is_set()
    assert first.result(timeout=60).step == 1
    assert s.steps() == [1, 2]


@pytest.mark.parametrize("seed", [True, False])
def test_background_failure_surfaces_on_the_future_and_puts_the_diff_base_back(seed):
    g = torch.Generator().manual_seed(3)
    s = _store(lock_timeout=0.2, seed_from_store=seed)
    t = random_table(g, 64, 4)
    s.put_tables(0, {"t": t})
    held = s.objects.writer()
    t1 = t.clone()
    t1[3] += 1
    f1 = s.put_tables(1, {"t": t1}, blocking=False)
    f1.add_done_callback(lambda _: held.abort())  # free the engine before put 2 runs
    t2 = t1.clone()
    t2[3] += 1
    f2 = s.put_tables(2, {"t": t2}, blocking=False)
    with pytest.raises(cnrstore.WriteFailed) as e1:
        f1.result(timeout=60)
    assert isinstance(e1.value.__cause__, engine.StoreLocked)
    with pytest.raises(cnrstore.WriteFailed, match="missing"):  # its base never committed
        f2.result(timeout=60)
    with pytest.raises(cnrstore.StepNotFound):
        s.get_tables(1)
    info = s.put_tables(3, {"t": t2})
    # The diff base is step 0's again, as the handle's put of step 0 left it (with or
    # without seeding): the failed puts are as if never tried.
    assert info.rows_changed == {"t": 1}
    assert info.objects_new < 10  # only block 0 and nodes are new
    assert s.steps() == [0, 3]
    assert_identical(s.get_tables(3)["t"], t2)
    assert s.verify().ok


def test_blocking_put_raises_write_failed():
    s = _store(lock_timeout=0.05)
    held = s.objects.writer()
    with pytest.raises(cnrstore.WriteFailed):
        s.put_tables(1, {"t": torch.ones(4, 2)})
    held.abort()
    assert s.steps() == []


def test_get_and_delete_of_a_pending_step_wait_for_it():
    g = torch.Generator().manual_seed(4)
    s = _store(lock_timeout=None)
    t = random_table(g, 40, 4)
    held = s.objects.writer()
    s.put_tables(1, {"t": t}, blocking=False)
    s.put_tables(2, {"t": t * 2}, blocking=False)
    result = {}
    getter = threading.Thread(target=lambda: result.update(s.get_tables(1)))
    getter.start()
    time.sleep(0.3)
    assert not result  # waiting for step 1
    held.abort()
    getter.join(timeout=60)
    assert_identical(result["t"], t)
    s.delete_step(2)
    assert s.steps() == [1]


def test_close_waits_for_pending_puts(tmp_path):
    g = torch.Generator().manual_seed(5)
    t = random_table(g, 500, 16)
    s = cnrstore.open(tmp_path / "s", block_rows=64)
    futs = [s.put_tables(k, {"t": t + k}, blocking=False) for k in range(3)]
    s.close()
    assert all(f.done() and f.exception() is None for f in futs)
    with cnrstore.open(tmp_path / "s") as s2:
        assert s2.steps() == [0, 1, 2]
        assert_identical(s2.get_tables(2)["t"], t + 2)


def test_diff_base_collected_by_another_handle_is_written_full():
    g = torch.Generator().manual_seed(6)
    a = _store(seed_from_store=False)
    t = random_table(g, 64, 4)
    a.put_tables(1, {"t": t})
    t[3] += 1
    a.put_tables(2, {"t": t})  # block 0 is a patch on step 1's block
    other = cnrstore.CheckpointStore(a.objects, block_rows=16, fanout=4)
    for step in other.steps():  # drop every step and block a's diff base refers to
        other.delete_step(step)
    other.gc()
    t[40] += 1
    info = a.put_tables(3, {"t": t})  # a's anchor step is gone: missing blocks go full
    assert info.rows_changed == {"t": 1}  # still diffed by fingerprint
    assert a.steps() == [3]
    assert_identical(a.get_tables(3)["t"], t)
    assert all(d == 0 for d in load_manifest(a.objects, 3).tables["t"].depth)
    assert a.verify().ok


def test_waiting_from_a_future_callback_raises_instead_of_hanging():
    s = _store(lock_timeout=None)
    seen = []

    def callback(fut):
        try:
            s.steps()  # would wait for the writer thread that runs this callback
        except RuntimeError as exc:
            seen.append(str(exc))

    held = s.objects.writer()  # keeps the put pending until the callback is registered
    fut = s.put_tables(1, {"t": torch.ones(3, 2)}, blocking=False)
    fut.add_done_callback(callback)
    held.abort()
    fut.result(timeout=30)
    s.close()  # returns: the writer thread is not stuck
    assert len(seen) == 1 and "writer thread" in seen[0]


def test_writer_does_not_keep_a_finished_puts_codes_alive():
    import gc

    s = _store()
    fut = s.put_tables(1, {"t": torch.randn(64, 4)}, quant="int8", blocking=False)
    assert fut.result(timeout=30).step == 1
    gc.collect()
    # The finished put's plan (and its host codes) is unreachable while the writer idles.
    assert not any(type(o).__name__ == "TablePlan" for o in gc.get_objects())
    s.close()


def test_pending_put_is_committed_at_interpreter_exit(tmp_path):
    import subprocess
    import sys

    code = (
        "import torch, cnrstore\n"
        f"s = cnrstore.open({str(tmp_path / 's')!r})\n"
        "s.put_tables(1, {'t': torch.arange(12.0).reshape(6, 2)}, blocking=False)\n"
        "# exits without waiting or closing\n"
    )
    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=repo)
    with cnrstore.open(tmp_path / "s") as s:
        assert s.steps() == [1]
        assert_identical(s.get_tables(1)["t"], torch.arange(12.0).reshape(6, 2))


def test_close_in_a_forked_child_does_not_hang(tmp_path):
    import os

    s = cnrstore.open(tmp_path / "s")
    s.put_tables(1, {"t": torch.ones(4, 2)})
    pid = os.fork()
    if pid == 0:  # child: closing must return at once, touching nothing of the parent's
        code = 1
        try:
            try:
                s.steps()
            except cnrstore.CheckpointError:  # refused: the handle belongs to the parent
                s.close()
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:  # poll, so a hanging child fails the test instead of hanging the suite
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("close() in the forked child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert s.steps() == [1]  # the parent's handle still works
    s.close()

"""Smallest reproductions of what the two-process model test (test_multiprocess_model.py)
found, each with real processes and a deterministic interleaving."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import torch

import cnrstore
import engine
from cnrstore.format.manifest import root_name


def _gc_child(path: str, started, out) -> None:
    try:
        with cnrstore.open(path, lock_timeout=60.0) as store:
            started.set()
            rep = store.gc(keep_last=2)
            out.put(("ok", rep.steps_deleted))
    except BaseException as exc:  # noqa: BLE001 - report anything to the parent
        out.put(("err", f"{type(exc).__name__}: {exc}"))


def test_gc_decides_what_to_drop_under_the_writer_lock(tmp_path):
    """gc listed the steps before taking the writer lock: a step another process deleted
    meanwhile made gc fail with the engine's ObjectNotFound (and a stale list could drop
    by an outdated rule). Here the parent holds the lock while the child's gc waits for
    it, deletes step 1 and releases: gc must then keep the newest two of what is left."""
    path = str(tmp_path / "ckpt")
    with cnrstore.open(path) as store:
        for step in (1, 2, 3):
            store.put_tables(step, {"t": torch.full((4, 2), float(step))})
    ctx = mp.get_context("spawn")
    started, out = ctx.Event(), ctx.Queue()
    objects = engine.open(path)
    try:
        w = objects.writer()
        child = ctx.Process(target=_gc_child, args=(path, started, out))
        child.start()
        assert started.wait(120)
        time.sleep(1.0)  # the child's gc is now waiting for the lock (listing done before)
        w.delete_root(root_name(1))
        w.commit()
        result = out.get(timeout=120)
        child.join(60)
    finally:
        objects.close()
    assert result == ("ok", ()), result
    with cnrstore.open(path) as store:
        assert store.steps() == [2, 3]
        assert store.verify().ok


def _child(path: str, op: str) -> None:
    with cnrstore.open(path, lock_timeout=60.0) as store:
        if op == "put2":
            store.put_tables(2, _tables(2, seed=2))
        else:
            assert store.gc(keep=[2]).steps_deleted == (1,)


def _tables(step: int, seed: int) -> dict:
    base = torch.randn(32, 4, generator=torch.Generator().manual_seed(seed))
    base[step % 32] = float(step)
    return {"t": base}


def _in_child(ctx, path: str, op: str) -> None:
    p = ctx.Process(target=_child, args=(path, op))
    p.start()
    p.join(120)
    assert p.exitcode == 0, op


def test_put_diffing_on_its_own_last_step_survives_gc_after_another_process_put(tmp_path):
    """A handle's put diffing against the handle's own last step was taken as safe from a
    racing gc ("its last put is the newest step"), so no full codes were kept. When another
    process had put a newer step, a gc keeping only that one swept the base blocks before
    the put committed and the put failed: WriteFailed "base block is missing". Here the
    handle's writer is held back (its queue, not the engine lock) while the other process
    puts step 2 and gcs step 1 away; the put must then write the lost blocks in full."""
    path = str(tmp_path / "ckpt")
    ctx = mp.get_context("spawn")
    with cnrstore.open(path, block_rows=8) as store:
        store.put_tables(1, _tables(1, seed=1))
        _in_child(ctx, path, "put2")
        gate = threading.Event()
        held = store._writer.submit(lambda: gate.wait(120))  # the next put waits behind it
        fut = store.put_tables(3, _tables(3, seed=1), blocking=False)  # planned on step 1
        _in_child(ctx, path, "gc")  # drops step 1 and sweeps its blocks
        gate.set()
        held.result()
        info = fut.result(timeout=120)
        assert info.rewritten_blocks > 0
        assert store.steps() == [2, 3]
        assert torch.equal(store.get_tables(3)["t"], _tables(3, seed=1)["t"])
        assert store.verify().ok

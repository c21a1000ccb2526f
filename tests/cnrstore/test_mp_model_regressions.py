"""Smallest reproductions of what the two-process model test (test_multiprocess_model.py)
found, each with real processes and a deterministic interleaving."""

from __future__ import annotations

import multiprocessing as mp
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

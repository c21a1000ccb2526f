"""Store processes of the two-process model test (test_multiprocess_model.py): each runs in
its own spawned interpreter with its own ``cnrstore.open`` handle and executes commands sent
by the coordinator over a pipe. Kept out of the test module so that spawn can import it by
name, and free of any checking: the coordinator owns the model."""

from __future__ import annotations

import time
import traceback

import torch

import cnrstore

BASE_ROWS = 40
DIM = 4
OPTS = {"block_rows": 8, "fanout": 2, "max_chain": 3, "lock_timeout": 60.0,
        "decode_threads": 1}


def tables(step: int, seed: int) -> dict[str, torch.Tensor]:
    """The tables a writer with ``seed`` puts as ``step``: a per-writer base with a few rows
    changed per step (so puts patch, share and seed from each other), 24..40 rows."""
    rows = 24 + 8 * (step % 3)
    base = torch.randn(BASE_ROWS, DIM, generator=torch.Generator().manual_seed(seed))
    changed = [i for i in range(BASE_ROWS) if (i * 7 + step) % 5 == 0]
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    base[changed] = torch.randn(len(changed), DIM, generator=g) * (1 + step % 4)
    ids = torch.arange(rows, dtype=torch.int64) * (step + 1) + seed
    return {"emb": base[:rows].clone(), "ids": ids}


def quant(step: int, seed: int) -> str:
    """"int8" for the float table on about a third of the puts, else "exact"."""
    return "int8" if (step + seed) % 3 == 0 else "exact"


def _run(store, cmd: tuple):
    op, args = cmd[0], cmd[1:]
    if op == "put":
        step, seed = args
        store.put_tables(step, tables(step, seed), quant={"emb": quant(step, seed)})
        return None
    if op == "delete":
        store.delete_step(args[0])
        return None
    if op == "rollback":
        return list(store.rollback(args[0]))
    if op == "gc":
        keep_last, keep = args
        rep = store.gc(keep_last=keep_last, keep=keep)
        return list(rep.steps_deleted)
    if op == "steps":
        return store.steps()
    if op == "get":
        return {k: v.numpy() for k, v in store.get_tables(args[0]).items()}
    if op == "verify":
        rep = store.verify()
        return list(rep.problems)
    raise ValueError(f"unknown command {op!r}")


def serve(conn) -> None:
    """Command loop: ("open", path) / ("close",) / ("exit",) / (at, cmd) where ``at`` is
    a time.time() to start at (so two processes start a racing pair together)."""
    store = path = None
    while True:
        msg = conn.recv()
        try:
            if msg[0] == "exit":
                if store is not None:
                    store.close()
                conn.send(("ok", None))
                return
            if msg[0] == "open":
                path = msg[1]
                store = cnrstore.open(path, **OPTS)
                conn.send(("ok", None))
                continue
            if msg[0] == "close":
                if store is not None:
                    store.close()
                store = None
                conn.send(("ok", None))
                continue
            at, cmd = msg
            delay = at - time.time()
            if delay > 0:
                time.sleep(delay)
            if cmd[0] == "reopen":  # a restarted job: its next put seeds from the store
                store.close()
                store = cnrstore.open(path, **OPTS)
                conn.send(("ok", None))
                continue
            conn.send(("ok", _run(store, cmd)))
        except Exception as exc:  # noqa: BLE001 - every outcome goes back to the model
            conn.send(("err", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))

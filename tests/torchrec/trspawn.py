"""Spawned gloo ranks for the TorchRec and sharded-leaf tests: every run has a deadline, and a
rank's exception comes back to the test as an AssertionError with its traceback."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback

from rankserver import context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, outdir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: tuple = ("err", "no result")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("err", traceback.format_exc())
    finally:
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn, world: int, *args, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; return each rank's
    result (picklable). A rank that fails or runs past ``timeout`` fails the test."""
    ctx = context()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read when the child's torch loads
    try:
        with tempfile.TemporaryDirectory() as outdir:
            port = free_port()
            procs = [ctx.Process(target=_entry, args=(r, world, port, outdir, fn, args))
                     for r in range(world)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            results = []
            for r in range(world):
                path = os.path.join(outdir, f"{r}.pkl")
                if not os.path.exists(path):
                    results.append(("err", f"rank {r} left no result (exit {procs[r].exitcode})"))
                    continue
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            errors = [f"rank {r}:\n{v}" for r, (k, v) in enumerate(results) if k != "ok"]
            if hung:
                errors.insert(0, f"ranks {hung} ran past {timeout} s")
            if errors:
                raise AssertionError("\n".join(errors))
            return [v for _, v in results]
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old

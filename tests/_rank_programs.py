"""Rank programs for tests/test_bench_ranks.py, importable by name in a spawned rank."""

from __future__ import annotations

import atexit
import os


def teardown_aborts(rank: int, world: int, value: int) -> dict:
    """Finishes its work, then aborts in the interpreter's teardown, as a spawned gloo
    rank of bench_torchrec now and then did (SIGABRT, "terminate called without an active
    exception") after writing its result."""
    import torch.distributed as dist

    dist.barrier()
    atexit.register(os.abort)
    return {"rank": rank, "world": world, "value": value}


def raises(rank: int, world: int) -> None:
    raise ValueError(f"rank {rank} of {world} refuses")


def dies(rank: int, world: int) -> None:
    os._exit(3)

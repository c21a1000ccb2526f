"""Rank programs of tests/distributed/test_dist_parity.py (module-level: spawned ranks
import them by name): what a DistributedStore offers as CheckpointStore does."""

from __future__ import annotations

import torch
from dist_util import BLOCK_ROWS, FANOUT

import cnrstore


def _open(path: str, **kw):
    import torch.distributed as dist

    return cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                         timeout=30.0, **kw)


def _err(fn) -> tuple[str, str] | None:
    try:
        fn()
    except cnrstore.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


def leaves_of_one_rank(rank: int, world: int, path: str) -> dict:
    """Rank 1 gives leaves rank 0 lacks: a plain tensor (a table-wise table it alone
    holds), a Python value and a whole sub-dict; what get_state returns on every rank."""
    out: dict = {}
    with _open(path) as s:
        state: dict = {"model": {"shared": torch.ones(4, 2)}, "epoch": 3}
        if rank == 1:
            state["model"]["mine"] = torch.arange(8.0).reshape(4, 2)
            state["loader"] = {"pos": 17, "name": "r1"}
        s.put_state(1, state)
        got = s.get_state(1)
        out["model"] = sorted(got["model"])
        out["mine"] = got["model"].get("mine")
        out["loader"] = got.get("loader")
        out["epoch"] = got["epoch"]
        # Each rank restores its own leaves in place, as it gave them.
        dest: dict = {"model": {"shared": torch.zeros(4, 2)}, "epoch": 0}
        if rank == 1:
            dest["model"]["mine"] = torch.zeros(4, 2)
            dest["loader"] = {"pos": 0, "name": ""}
        back = s.load_state(1, dest)
        out["back"] = (back["epoch"], back.get("loader"),
                       None if rank == 0 else torch.equal(dest["model"]["mine"],
                                                          state["model"]["mine"]))
        # Ranks that give one path as a tensor and as a dict: refused before anything is
        # written, on every rank.
        clash: dict = {"x": torch.ones(2, 2)} if rank == 0 else {"x": {"y": torch.ones(2, 2)}}
        out["clash"] = _err(lambda: s.put_state(2, clash))
        out["steps"] = s.steps()
    return out

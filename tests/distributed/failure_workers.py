"""Rank programs of the tests that a failed distributed put changes no later id
(test_dist_failures.py; module-level: spawned ranks import them by name)."""

from __future__ import annotations

import os

import torch
from ckpt_util import tracked_run
from dist_util import BLOCK_ROWS, FANOUT
from dist_workers import _mine

import cnrstore


def small_steps(delta: float, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The run every rank puts (ckpt_util.tracked_run): the same on every rank."""
    return tracked_run(delta, n, seed=5, width=4)


def failed_then_tracked(rank: int, world: int, path: str, quant: str, delta: float,
                        point: str, victim: int):
    """Tracker-driven non-blocking puts of ``small_steps``, each rank's table overwritten
    as soon as its put returns; rank ``victim``'s write of step 2 fails at ``point`` as a
    full disk would, and the later puts pass the rows touched since that failed put only
    (its tracker was consumed). (every step's ids or error name, the last step's rows
    read back equal to the table, verify)."""
    import torch.distributed as dist

    run = small_steps(delta)
    t = run[0][0].clone()
    mine = _mine(t, rank, world)
    lo, hi = mine.row_offset, mine.row_end
    out: dict = {}
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=20.0) as s:
        out[0] = s.put_tables(0, {"t": mine}, quant=quant).tables
        for step, (values, touched) in enumerate(run[1:], start=1):
            assert touched is not None
            t.copy_(values)
            own = touched[(touched >= lo) & (touched < hi)]
            if step == 2 and rank == victim:
                os.environ["CNRSTORE_DIST_FAIL_AT"] = point
            try:
                fut = s.put_tables(step, {"t": mine}, quant=quant, blocking=False,
                                   touched={"t": own})
                out[step] = fut.result().tables
            except cnrstore.CheckpointError as exc:
                out[step] = type(exc).__name__
            os.environ.pop("CNRSTORE_DIST_FAIL_AT", None)
        same = torch.equal(s.get_tables(s.steps()[-1])["t"], t) if quant == "exact" else None
        return out, same, s.verify().ok

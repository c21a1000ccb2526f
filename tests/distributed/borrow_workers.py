"""Rank programs of test_dist_borrowed_put.py (module-level: spawned ranks import them)."""

from __future__ import annotations

import collections

import torch
from dist_util import BLOCK_ROWS, FANOUT

import cnrstore

ROWS = 40 * BLOCK_ROWS + 5  # uneven: every rank's piece has whole blocks and a boundary


def table(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(step))


CUTS = {2: [0, 7 * BLOCK_ROWS + 3, ROWS],
        3: [0, 7 * BLOCK_ROWS + 3, 25 * BLOCK_ROWS + 11, ROWS],
        4: [0, 301, 700, 1000, ROWS]}


def cut(world: int) -> list[int]:
    return CUTS[world]


def mine(t: torch.Tensor, rank: int, world: int) -> cnrstore.Shard:
    c = cut(world)
    return cnrstore.Shard(t[c[rank]:c[rank + 1]], row_offset=c[rank], rows=ROWS)


def _open(path: str):
    import torch.distributed as dist

    return cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                         timeout=30)


def staged(rank: int, world: int, path: str):
    """A blocking put of whole exact runs, then a non-blocking one whose table changes as
    it returns: (bytes the rank's host buffers held after each, the rank's piece's bytes,
    both steps restored equal to the tables at call time)."""
    t1, t2 = table(1), table(2)
    with _open(path) as s:
        s.put_tables(1, {"t": mine(t1, rank, world)})
        after_blocking = s.buffers.held_bytes()
        piece = mine(t2, rank, world)
        want2 = t2.clone()
        fut = s.put_tables(2, {"u": piece}, blocking=False)
        piece.local.fill_(-7.0)  # not waited for: the put copied its rows
        fut.result()
        after_nonblocking = s.buffers.held_bytes()
        got = s.get_tables(1, out={"t": mine(torch.zeros(ROWS, 8), rank, world)})
        ok1 = torch.equal(got["t"].local, mine(t1, rank, world).local)
        got2 = s.get_tables(2, out={"u": mine(torch.zeros(ROWS, 8), rank, world)})
        ok2 = torch.equal(got2["u"].local, mine(want2, rank, world).local)
        return after_blocking, after_nonblocking, mine(t1, rank, world).local.nbytes, ok1, ok2


class _Interrupting(collections.deque):
    """Stands in for the writer's job list on one rank: the put's append queues the job,
    then raises KeyboardInterrupt, as a Ctrl-C landing just after the job was queued (a
    put's job is the one with a cleanup; a drain's, queued before it, has none)."""

    def __init__(self, jobs):
        super().__init__(jobs)
        self.armed = True

    def append(self, item):
        super().append(item)
        if self.armed and item[2] is not None:
            self.armed = False
            raise KeyboardInterrupt


def interrupted(rank: int, world: int, path: str):
    """Rank 0's caller stops waiting (Ctrl-C) as soon as its blocking put is queued and
    overwrites its table at once; its writer reads the borrowed rows only after that
    (it waits for the interrupt first). The step must fail on every rank, since it would
    hold the overwritten rows, and the next put must work. (what the put raised, steps
    after it, step 2 restored equal, steps at the end)."""
    from cnrstore.distributed import commit

    t = table(1)
    piece = mine(t, rank, world)
    with _open(path) as s:
        if rank == 0:
            real = commit.write_blocks

            def late(coll, plan, get):
                if plan.borrowed is not None:
                    plan.borrowed.wait(30)  # read the table only once the caller left
                return real(coll, plan, get)

            commit.write_blocks = late
            s.writer._jobs = _Interrupting(s.writer._jobs)
        try:
            s.put_tables(1, {"t": piece})
            raised = None
        except KeyboardInterrupt:
            raised = "KeyboardInterrupt"
            piece.local.fill_(-7.0)
        except cnrstore.CheckpointError as exc:
            raised = f"{type(exc).__name__}: {exc}"
        if rank == 0:
            commit.write_blocks = real
        steps = s.steps()  # after the failed job: the writer runs jobs in order
        t2 = table(2)
        s.put_tables(2, {"t": mine(t2, rank, world)})
        got = s.get_tables(2, out={"t": mine(torch.zeros(ROWS, 8), rank, world)})
        return raised, steps, torch.equal(got["t"].local, mine(t2, rank, world).local), \
            s.steps()

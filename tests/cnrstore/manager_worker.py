"""Ranks of tests/cnrstore/test_manager.py's many-rank test (spawned by dist_util.run)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cnrstore


class Clock:
    """A clock each rank advances itself; rank 1's runs twice as fast as rank 0's, so a
    rank that read its own clock would decide otherwise than the coordinator."""

    def __init__(self, rank: int):
        self.t = 0.0
        self.rate = 1.0 + rank

    def __call__(self) -> float:
        return self.t * self.rate


def train_and_save(rank: int, world: int, path: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Embedding(40, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    clock = Clock(rank)
    saved = []
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=8) as store:
        mgr = cnrstore.CheckpointManager(store, save_interval_steps=4,
                                         save_interval_seconds=10.0, max_to_keep=2,
                                         keep_best=1, best_metric="loss", clock=clock)
        for step in range(1, 13):
            loss = model(torch.arange(40)).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            clock.t += 3.0
            if mgr.save(step, {"model": model, "optim": opt},
                        metrics={"loss": float(loss) if step != 5 else -1.0}):
                saved.append(step)
        mgr.wait()
        steps = mgr.all_steps()
        fresh = torch.nn.Embedding(40, 4)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        mgr.restore(into={"model": fresh, "optim": fresh_opt})
        same = torch.equal(fresh.weight, model.weight) and all(
            torch.equal(fresh_opt.state[fresh.weight][k], opt.state[model.weight][k])
            for k in ("exp_avg", "exp_avg_sq", "step"))
        return {"saved": saved, "steps": steps, "store_steps": store.steps(), "same": same}

"""The small embedding model and training loop the rank programs of the optimizer-state
tests share (module-level: spawned ranks import it)."""

from __future__ import annotations

import torch


class TinyNet(torch.nn.Module):
    """An embedding of 40 rows x 4 and a linear head, initialised from ``seed``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(40, 4)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).sum(1)).squeeze(1)


def train_steps(model, opt, steps) -> None:
    """One optimizer step per entry of ``steps``, on a batch drawn from the step number:
    the same batches on every rank and in every run."""
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ids, y = torch.randint(0, 40, (8, 3), generator=g), torch.randn(8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y).backward()
        opt.step()

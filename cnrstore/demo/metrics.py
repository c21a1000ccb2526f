"""How well the demo's DLRM learned: AUC, log loss on held-out batches, and the teacher's
own loss (the floor a perfect student would reach)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["auc", "evaluate", "teacher_floor"]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve, rank-based (Mann-Whitney U), ties given their mean rank."""
    s = scores.detach().double().cpu().numpy().ravel()
    y = labels.detach().cpu().numpy().ravel().astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in size: {s.shape} vs {y.shape}")
    n_pos = int(y.sum())
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs at least one positive and one negative label")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1          # 1-based rank of each tie group
    mean_rank = first_rank + (counts - 1) / 2.0
    rank_sum = mean_rank[inverse][y].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list) -> tuple[float, float]:
    """(mean log loss, AUC) of ``model`` on ``batches`` (cnrstore.demo.dlrm.Batch)."""
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]
    logits = torch.cat([model(b.dense, b.ids) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    return float(F.binary_cross_entropy_with_logits(logits, labels)), auc(logits, labels)


def teacher_floor(batches: list) -> float:
    """The teacher's own log loss on ``batches``: what a perfect student would reach."""
    logits = torch.cat([b.teacher_logits for b in batches])
    labels = torch.cat([b.labels for b in batches])
    return float(F.binary_cross_entropy_with_logits(logits, labels))

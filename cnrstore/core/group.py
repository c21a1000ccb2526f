"""The communication seam of the put pipeline: the few rounds a put takes among the ranks
of a store handle, and the world of one a single-process handle is (docs/ARCHITECTURE.md,
"A put and a get"; docs/design/one-pipeline.md).

Every round is entered by every rank, also one whose local work failed: it enters with
its error and every rank raises the same error (``agree``). ``Group`` is what
core/put.py calls; cnrstore/distributed/comm.py's ``Comm`` is the gloo implementation and
``Solo`` the world of one, which communicates nothing: its rounds return this process's
own value, and raise this process's own error as it is (not a copy naming a rank).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

import torch

from cnrstore.errors import CheckpointError, translate
from engine import StoreError

__all__ = ["Group", "Solo", "rebuild_error", "wire_error"]


class Group(Protocol):
    """The ranks of a store handle, as the put pipeline talks to them."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def coordinator(self) -> bool: ...

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        ...

    def agree(self, error: BaseException | None, what: str, payload: Any = None
              ) -> list[Any]:
        """Every rank's ``payload``, or the lowest failing rank's error on every rank."""
        ...

    def from_coordinator(self, what: str, fn: Callable[[], Any], *,
                         scatter: bool = True) -> Any:
        """``fn()`` run on the coordinator: its list, one answer per rank (``scatter``), or
        its one answer for all; its error raised on every rank."""
        ...

    def exchange(self, buf: torch.Tensor, sizes: list[int], expect: list[int], what: str
                 ) -> list[torch.Tensor]:
        """Point to point: ``sizes[r]`` bytes of ``buf`` to rank r, ``expect[r]`` from it."""
        ...


class Solo:
    """A world of one: this process is rank 0, the coordinator, and every round is local."""

    rank = 0
    world = 1
    coordinator = True

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        return [obj]

    def agree(self, error: BaseException | None, what: str, payload: Any = None
              ) -> list[Any]:
        if error is not None:
            raise error
        return [payload]

    def from_coordinator(self, what: str, fn: Callable[[], Any], *,
                         scatter: bool = True) -> Any:
        value = fn()
        return value[0] if scatter else value

    def exchange(self, buf: torch.Tensor, sizes: list[int], expect: list[int], what: str
                 ) -> list[torch.Tensor]:
        return [buf[:sizes[0]]]


def wire_error(exc: BaseException) -> tuple[str, str, str, dict]:
    """A picklable description of ``exc`` (cnrstore's errors have custom constructors
    that pickle cannot call back)."""
    attrs = {k: v for k, v in vars(exc).items()
             if isinstance(v, (int, str, float, bytes, type(None)))}
    return type(exc).__module__, type(exc).__qualname__, str(exc), attrs


def rebuild_error(wire: tuple[str, str, str, dict], rank: int) -> CheckpointError:
    """The error of ``wire`` raised on rank ``rank``, as a CheckpointError naming it."""
    module, name, message, attrs = wire
    text = f"rank {rank}: {message}" if not message.startswith("rank ") else message
    cls: Any = None
    if module == "cnrstore.errors":
        cls = getattr(importlib.import_module(module), name, None)
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        exc = cls.__new__(cls)
        Exception.__init__(exc, text)
        exc.__dict__.update(attrs)
        return exc
    return CheckpointError(f"rank {rank}: {name}: {message}")


def coordinator_box(world: int, fn: Callable[[], Any], scatter: bool) -> Any:
    """What the coordinator sends for ``from_coordinator``: ("ok", value) per rank or for
    all, or its error on the wire (the engine's translated into cnrstore's tree)."""
    try:
        value = fn()
        return [("ok", v) for v in value] if scatter else ("ok", value)
    except BaseException as exc:
        if isinstance(exc, StoreError):
            exc = translate(exc)
        wire = ("err", wire_error(exc))
        return [wire] * world if scatter else wire

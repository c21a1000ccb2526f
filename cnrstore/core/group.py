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

from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["Group", "Solo"]


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

    def exchange(self, buf: torch.Tensor, sizes: list[int], expect: list[int], what: str,
                 out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Point to point: ``sizes[r]`` bytes of ``buf`` to rank r, ``expect[r]`` from it
        (into ``out`` where given)."""
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

    def exchange(self, buf: torch.Tensor, sizes: list[int], expect: list[int], what: str,
                 out: torch.Tensor | None = None) -> list[torch.Tensor]:
        return [buf[:sizes[0]]]

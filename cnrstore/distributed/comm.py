"""The distributed store's own collectives: a gloo group per use, errors carried across
ranks, and a dead or hung rank turned into ``RankFailed`` within the timeout.

Every collective operation is a sequence of rounds; each round is an ``all_gather`` (or a
broadcast from the coordinator) that every rank enters, also a rank whose local work
failed: it enters with its error, and every rank then raises the same error
(``agree``). A rank that skipped a round would leave the others waiting for the timeout.
"""

from __future__ import annotations

import datetime
import importlib
from typing import Any

import torch
import torch.distributed as dist

from cnrstore.errors import CheckpointError, RankFailed

__all__ = ["Comm", "wire_error", "rebuild_error"]


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


class Comm:
    """One gloo process group over the ranks of the user's group, used by one thread."""

    def __init__(self, ranks: list[int], timeout: float):
        self.ranks = ranks
        self.timeout = timeout
        # Not use_local_synchronization: its group name is a hash of the ranks, the same
        # for both groups of a handle and for a reopened handle, and their rendezvous
        # keys then collide (a hang, seen in tests). So, as for dist.new_group, every
        # process of the default group takes part in opening the store.
        self.pg = dist.new_group(ranks, backend="gloo",
                                 timeout=datetime.timedelta(seconds=timeout))
        self.rank = dist.get_rank(self.pg)
        self.world = dist.get_world_size(self.pg)
        self.broken: str | None = None

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def _run(self, what: str, fn: Any) -> Any:
        if self.broken is not None:
            raise RankFailed(f"{what}: the store's process group failed earlier "
                             f"({self.broken}); close the store and open it again")
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError, ConnectionError) as exc:
            # gloo reports a dead peer (connection reset) at once, a hung one at the timeout
            self.broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RankFailed(f"{what}: a rank died or did not answer within "
                             f"{self.timeout:g} s: {self.broken}") from exc

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._run(what, lambda: dist.all_gather_object(out, obj, group=self.pg))
        return out

    def bcast(self, obj: Any, what: str) -> Any:
        """``obj`` of the coordinator, on every rank."""
        box = [obj if self.coordinator else None]
        self._run(what, lambda: dist.broadcast_object_list(
            box, src=dist.get_global_rank(self.pg, 0), group=self.pg))
        return box[0]

    def scatter(self, objs: list[Any] | None, what: str) -> Any:
        """``objs[rank]`` of the coordinator's list, on each rank."""
        box: list[Any] = [None]
        self._run(what, lambda: dist.scatter_object_list(
            box, objs if self.coordinator else None,
            src=dist.get_global_rank(self.pg, 0), group=self.pg))
        return box[0]

    def exchange(self, buf: torch.Tensor, sizes: list[int], expect: list[int], what: str
                 ) -> list[torch.Tensor]:
        """Point to point: ``sizes[r]`` bytes of the uint8 ``buf`` (in rank order) go to
        rank r, and ``expect[r]`` bytes come from it (the ranks agreed on both before).
        Returns the bytes from each rank. Unlike an all-gather, each byte crosses once,
        to its one reader, unpickled and unpadded."""
        out = torch.empty(sum(expect), dtype=torch.uint8)
        self._run(what, lambda: dist.all_to_all_single(
            out, buf, output_split_sizes=expect, input_split_sizes=sizes, group=self.pg))
        return list(torch.split(out, expect))

    def agree(self, error: BaseException | None, what: str, payload: Any = None
              ) -> list[Any]:
        """All-gather ``(error, payload)``; raise the lowest rank's error on every rank,
        else return every rank's payload."""
        sent = (None if error is None else wire_error(error), payload)
        got = self.all_gather(sent, what)
        for r, (err, _) in enumerate(got):
            if err is not None:
                exc = rebuild_error(err, r)
                if r == self.rank and error is not None:
                    raise exc from error
                raise exc
        return [p for _, p in got]

    def close(self) -> None:
        if self.broken is None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception:  # closing anyway
                pass

"""The distributed store's own collectives: a gloo group per use, errors carried across
ranks, and a dead or hung rank turned into ``RankFailed`` within the timeout.

Every collective operation is a sequence of rounds; each round is an ``all_gather`` (or a
broadcast from the coordinator) that every rank enters, also a rank whose local work
failed: it enters with its error, and every rank then raises the same error
(``agree``). A rank that skipped a round would leave the others waiting for the timeout.

Every round carries its name and the handle's round number, and every public call
begins with an all-gather: ranks that are in different calls (one called ``steps()``,
another ``put_tables``, or one skipped a call) meet at the next all-gather, and every
rank raises the same CollectiveMismatch naming what each was in, instead of exchanging
one call's bytes for another's (or hanging until the timeout and blaming a dead rank).
"""

from __future__ import annotations

import datetime
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cnrstore.errors import CheckpointError, CollectiveMismatch, RankFailed, translate
from engine import StoreError

__all__ = ["Comm", "coordinator_box", "payloads", "rebuild_error", "unbox", "wire_error"]



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


def payloads(got: list, rank: int, error: BaseException | None) -> list[Any]:
    """Every rank's payload of an all-gathered ``(wire error, payload)`` round, or the
    lowest rank's error raised (chained to ``error`` where it is this rank's own)."""
    for r, (err, _) in enumerate(got):
        if err is not None:
            exc = rebuild_error(err, r)
            if r == rank and error is not None:
                raise exc from error
            raise exc
    return [p for _, p in got]


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


def unbox(box: Any) -> Any:
    """The value of one of ``coordinator_box``'s answers, or its error raised."""
    if box[0] == "err":
        raise rebuild_error(box[1], 0)
    return box[1]


class Comm:
    """One gloo process group over the ranks of the user's group, used by one thread: the
    gloo implementation of the put pipeline's seam (core/group.py ``Group``)."""

    def __init__(self, ranks: list[int], timeout: float):
        self.ranks = ranks
        self.timeout = timeout
        # Not use_local_synchronization: its group name is a hash of the ranks, the same
        # for both groups of a handle and for a reopened handle, and their rendezvous
        # keys then collide (a hang, seen in tests). So, as for dist.new_group, every
        # process of the default group takes part in opening the store.
        try:
            self.pg = dist.new_group(ranks, backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout))
        except (RuntimeError, ConnectionError) as exc:  # DistStoreError: a rank never came
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RankFailed(
                f"open: not every rank of the default group joined within {timeout:g} s "
                f"({first}); every process of the default group must call cnrstore.open "
                "with group=, at the same point") from exc
        self.rank = dist.get_rank(self.pg)
        self.world = dist.get_world_size(self.pg)
        self.broken: str | None = None
        self.rounds = 0  # rounds this handle's rank entered: the same on every rank

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    def _run(self, what: str, fn: Any) -> Any:
        if self.broken is not None:
            raise RankFailed(f"{what}: the store's process group failed earlier "
                             f"({self.broken}); close the store and open it again")
        self.rounds += 1
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError, ConnectionError) as exc:
            # gloo reports a dead peer (connection reset) at once, a hung one at the timeout
            self.broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise RankFailed(f"{what}: a rank died, did not answer within "
                             f"{self.timeout:g} s, or did not make this call (every rank "
                             f"must make the same store calls in the same order): "
                             f"{self.broken}") from exc

    def _tag(self, what: str) -> tuple[str, int]:
        return (what, self.rounds + 1)  # the number _run gives the round

    def _mismatch(self, tags: list[Any]) -> CollectiveMismatch:
        calls = [tuple(t) if isinstance(t, (tuple, list)) else ("?", -1) for t in tags]
        said = ", ".join(f"rank {r} in {w!r} (round {n})" if n >= 0 else
                         f"rank {r} in another round" for r, (w, n) in enumerate(calls))
        self.broken = "the ranks made different store calls"
        return CollectiveMismatch(
            f"the ranks are not in the same store call: {said}. Every method of a "
            "distributed store is collective: every rank must make the same calls in the "
            "same order. The handle is unusable now: close it and open the store again",
            calls=calls)

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        tag = self._tag(what)
        out: list[Any] = [None] * self.world
        self._run(what, lambda: dist.all_gather_object(out, (tag, obj), group=self.pg))
        tags = [got[0] if isinstance(got, tuple) and len(got) == 2 else None for got in out]
        if any(t != tag for t in tags):  # every rank sees the same list: all raise
            raise self._mismatch(tags)
        return [got[1] for got in out]

    def bcast(self, obj: Any, what: str) -> Any:
        """``obj`` of the coordinator, on every rank."""
        tag = self._tag(what)
        box = [(tag, obj) if self.coordinator else None]
        self._run(what, lambda: dist.broadcast_object_list(
            box, src=dist.get_global_rank(self.pg, 0), group=self.pg))
        return self._untag(box[0], tag)

    def scatter(self, objs: list[Any] | None, what: str) -> Any:
        """``objs[rank]`` of the coordinator's list, on each rank."""
        tag = self._tag(what)
        box: list[Any] = [None]
        self._run(what, lambda: dist.scatter_object_list(
            box, [(tag, o) for o in objs] if self.coordinator and objs is not None else None,
            src=dist.get_global_rank(self.pg, 0), group=self.pg))
        return self._untag(box[0], tag)

    def _untag(self, got: Any, tag: tuple[str, int]) -> Any:
        # A round only the coordinator sends in: a receiver that is elsewhere finds out
        # here (the coordinator at the next all-gather, which every call begins with).
        sent = got[0] if isinstance(got, tuple) and len(got) == 2 else None
        if sent != tag:
            raise self._mismatch([sent if r == 0 else tag if r == self.rank else ("?", -1)
                                  for r in range(self.world)])
        return got[1]

    def from_coordinator(self, what: str, fn: Callable[[], Any], *,
                         scatter: bool = True) -> Any:
        """``fn()`` run on the coordinator: a list with one answer per rank (``scatter``)
        or one answer for all; its error is raised on every rank."""
        box = coordinator_box(self.world, fn, scatter) if self.coordinator else None
        return unbox(self.scatter(box, what) if scatter else self.bcast(box, what))

    def exchange(self, buf: torch.Tensor, sizes: list[int], expect: list[int], what: str,
                 out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Point to point: ``sizes[r]`` bytes of the uint8 ``buf`` (in rank order) go to
        rank r, and ``expect[r]`` bytes come from it (the ranks agreed on both before).
        Returns the bytes from each rank (views of ``out`` where given: a uint8 buffer of
        at least that many bytes). Unlike an all-gather, each byte crosses once, to its
        one reader, unpickled and unpadded."""
        out = torch.empty(sum(expect), dtype=torch.uint8) if out is None else \
            out[:sum(expect)]
        self._run(what, lambda: dist.all_to_all_single(
            out, buf, output_split_sizes=expect, input_split_sizes=sizes, group=self.pg))
        return list(torch.split(out, expect))

    def agree(self, error: BaseException | None, what: str, payload: Any = None
              ) -> list[Any]:
        """All-gather ``(error, payload)``; raise the lowest rank's error on every rank,
        else return every rank's payload."""
        sent = (None if error is None else wire_error(error), payload)
        return payloads(self.all_gather(sent, what), self.rank, error)

    def close(self) -> None:
        if self.broken is None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception:  # closing anyway
                pass

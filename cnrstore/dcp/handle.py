"""The store a DCP writer or reader works on: an open store used as it is, or a path
opened (collectively, on every rank of the group) for one save or load, and kept open
for the next one of this process while nothing else changes the store (stores.py).

DCP runs its steps on every rank, and a rank whose own part failed still reaches the
next of cnrstore's rounds with its error (``agree``), so every rank raises the same error
and none waits for another. A plain store (one process, ``no_dist=True``) has no rounds.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from cnrstore.core.store import CheckpointStore
from cnrstore.dcp import stores
from cnrstore.distributed.opener import open as open_store
from cnrstore.distributed.store import DistributedStore
from cnrstore.errors import InvalidInput, InvalidType

__all__ = ["Target"]


class Target:
    """A store given as an open handle or as a path (with the keyword arguments of
    ``cnrstore.open``); picklable when given as a path (DCP's process executor sends the
    writer to its checkpoint process, which opens the path itself)."""

    def __init__(self, store: Any, group: Any, open_kwargs: dict[str, Any]):
        if isinstance(store, (CheckpointStore, DistributedStore)):
            if group not in (None, False) or open_kwargs:
                raise InvalidInput("group= and open options are for a path; an open store "
                                   "is used as it was opened")
            self.path: str | None = None
            self.store: Any = store
        elif isinstance(store, (str, os.PathLike)):
            self.path = os.fspath(store)
            self.store = None
        else:
            raise InvalidType("the first argument must be a store path or an open cnrstore "
                              f"store, got {type(store).__name__}")
        self.group = group
        self.open_kwargs = dict(open_kwargs)
        self.first: Any = None  # the open's first answer, to take (``open``)

    def __getstate__(self) -> dict:
        if self.path is None:
            raise InvalidInput("an open cnrstore store cannot be sent to another process "
                               "(DCP's process executor): give the writer the store's path")
        return {**self.__dict__, "store": None, "first": None}

    def reset(self, checkpoint_id: Any) -> None:
        """DCP's checkpoint_id, when given, is the store's path."""
        if checkpoint_id is None:
            return
        if self.path is None:
            raise InvalidInput("checkpoint_id names a store path; this writer or reader was "
                               "given an open store")
        self.path = os.fspath(checkpoint_id)

    def group_of(self) -> Any:
        if self.group is False:  # this process alone (no_dist=True inside a many-rank job)
            return None
        if self.group is not None:
            return self.group
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist.group.WORLD
        return None

    def open(self, first: Any = None) -> Any:
        """The store, opened now if given as a path (collective with a group): the one
        kept open from this process's last save or load of the path (stores.py).
        ``first``: a coordinated call (``fn(coordinator's store)``) that the open's own
        round carries where the path is opened anew with a group; its answer is then
        ``self.first`` (``DistributedStore.take_first``), else None."""
        self.first = None
        if self.store is None:
            assert self.path is not None
            path, group, kwargs = self.path, self.group_of(), self.open_kwargs

            def opener() -> Any:
                if group is None or first is None:
                    return open_store(path, group=group, **kwargs)
                store = open_store(path, group=group, first=first, **kwargs)
                self.first = store.take_first
                return store

            self.store = (stores.checkout(path, group, kwargs, opener)
                          if stores.cacheable(path, kwargs) else opener())
        return self.store

    def done(self, wrote: tuple[str, bytes] | None = None) -> None:
        """After a save or load: give back (or close) a store this target opened;
        ``wrote``: the root the save committed (name, id)."""
        if self.path is not None and self.store is not None:
            store, self.store = self.store, None
            if stores.cacheable(self.path, self.open_kwargs):
                stores.checkin(store, wrote)
            else:
                store.close()

    def agree(self, err: BaseException | None, what: str, payload: Any = None) -> list[Any]:
        """Every rank's payload, or the lowest failed rank's error raised on every rank."""
        store = self.store
        if isinstance(store, DistributedStore):
            return store.comm.agree(err, what, payload)
        if err is not None:
            raise err
        return [payload]

"""How the tools reach a store: a CheckpointStore, an engine ObjectStore or a path, and
the steps a command asked for. Shared by info and check (neither imports the other)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import engine
from cnrstore.errors import BadPath, InvalidType, StepNotFound
from cnrstore.format.load import list_steps
from engine import ObjectStore

__all__ = ["objects_of", "opened", "selected_steps", "tick"]


def objects_of(store) -> ObjectStore:
    """The engine object store behind ``store`` (a CheckpointStore or an ObjectStore)."""
    if isinstance(store, ObjectStore):
        return store
    inner = getattr(store, "objects", None)  # CheckpointStore.objects
    if isinstance(inner, ObjectStore):
        return inner
    raise InvalidType(f"expected a CheckpointStore, an engine ObjectStore or a path, got "
                    f"{type(store).__name__}")


@contextlib.contextmanager
def opened(store) -> Iterator[ObjectStore]:
    """Yield the engine store of ``store``; a path is opened (never created) and closed."""
    if isinstance(store, (str, os.PathLike)):
        if not os.path.isdir(store):
            raise BadPath(f"no store at {os.fspath(store)!r}", path=os.fspath(store))
        objects = engine.open(store, create=False)
        try:
            yield objects
        finally:
            objects.close()
    else:
        yield objects_of(store)


def selected_steps(objects: ObjectStore, steps: Iterable[int] | None) -> list[int]:
    have = list_steps(objects)
    if steps is None:
        return have
    wanted = sorted(set(steps))
    for s in wanted:
        if s not in have:
            raise StepNotFound(s)
    return wanted


def tick(progress, done: int, total: int) -> None:
    if progress is not None:
        progress(done, total)



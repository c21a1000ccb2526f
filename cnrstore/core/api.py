"""The API of a checkpoint store handle, as one ``typing.Protocol`` that both handles
satisfy: ``CheckpointStore`` (one process, cnrstore/core/store.py) and
``DistributedStore`` (every method collective, cnrstore/distributed/store.py). mypy
checks each class against it (the ``_is_store_api`` functions beside them) and
tests/cnrstore/test_store_api.py checks the signatures themselves, parameter by
parameter, so the two classes' methods cannot drift apart. A method both handles have
belongs here; what only one has (CheckpointStore's ``progress=``, a rank's plumbing) is
listed by that test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from cnrstore.core.options import Options
from cnrstore.core.writer import StepInfo

__all__ = ["StoreAPI"]


class StoreAPI(Protocol):
    """What code written against "a checkpoint store" may call (the docstrings are the
    classes')."""

    @property
    def options(self) -> Options: ...

    def close(self) -> None: ...

    def put_tables(self, step: int, tables: Mapping, *, quant: Any = "exact",
                   metadata: Mapping | None = None, blocking: bool = True,
                   touched: Mapping | None = None) -> StepInfo | Future: ...

    def put_state(self, step: int, state: Any, *, quant: Any = None,
                  metadata: Mapping | None = None, blocking: bool = True,
                  touched: Mapping | None = None) -> StepInfo | Future: ...

    def get_tables(self, step: int | None = None, *, names: Iterable[str] | None = None,
                   rows: Mapping[str, slice] | None = None, device: Any = "cpu",
                   out: Mapping | None = None) -> dict: ...

    def get_state(self, step: int | None = None, *, device: Any = "cpu",
                  names: Iterable[str] | None = None) -> Any: ...

    def load_state(self, step: int | None, state: Any, *, strict: bool = True,
                   names: Iterable[str] | None = None) -> Any: ...

    def changes(self, a: int, b: int, names: Iterable[str] | None = None, *,
                rows: Mapping[str, slice] | None = None, strict: bool = False) -> Any: ...

    def metadata(self, step: int | None = None) -> dict: ...

    def steps(self) -> list[int]: ...

    def delete_step(self, step: int) -> None: ...

    def delete_steps(self, steps: Iterable[int]) -> list[int]: ...

    def rollback(self, step: int) -> list[int]: ...

    def gc(self, keep_last: int | None = None, keep: Iterable[int] = (), *,
           threshold: float = 0.25) -> Any: ...

    def verify(self, *, deep: bool = True) -> Any: ...

    def stats(self) -> Any: ...

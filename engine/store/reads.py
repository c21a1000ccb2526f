"""``DirectReads``: the pack store's reads into caller memory and by location, and the
read-ahead hints, on the store's ``PackStoreState`` (engine/store/core.py). A mixin of
``PackStore`` kept apart for module size."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..api import Object
from ..format.ids import check_id
from ..format.location import RecordLocation
from .batchread import read_many_at
from .coordinator import locate_closure
from .core import PackStoreState


class DirectReads:
    """``ObjectStore.get_into`` and ``prefetch`` of a PackStore, over its PackStoreState (here
    because engine/store/packstore.py is at its module size limit)."""

    _core: PackStoreState

    def get_into(self, oid: bytes, kind: int, prefix: int, out: memoryview, *,
                 id_check: bool = True, fallback: bool = False) -> bytes | Object | None:
        self._core.check_open()
        check_id(oid)
        return self._core.read_into(bytes(oid), kind, prefix, out, id_check=id_check,
                                    fallback=fallback)

    def prefetch(self, oids: Iterable[bytes]) -> None:
        self._core.check_open()
        self._core.advise(locate_closure(self._core, oids).values())

    def get_at(self, loc: RecordLocation) -> Object:
        self._core.check_open()
        return self._core.read(loc.oid, at=loc)

    def get_many_at(self, locs: Sequence[RecordLocation], *, hint: bool = False,
                    views: bool = False) -> list[Object]:
        self._core.check_open()
        core = self._core
        return read_many_at(core.readers, list(locs), core.dctx(),
                            lambda loc: core.read(loc.oid, at=loc), hint=hint, views=views)

    def get_into_at(self, loc: RecordLocation, kind: int, prefix: int, out: memoryview, *,
                    id_check: bool = True, fallback: bool = False
                    ) -> bytes | Object | None:
        self._core.check_open()
        return self._core.read_into(loc.oid, kind, prefix, out, id_check=id_check,
                                    fallback=fallback, at=loc)

    def prefetch_at(self, locs: Iterable[RecordLocation]) -> None:
        self._core.check_open()
        self._core.advise(locs)

"""The commit log of a store on a local directory: its LMDB index is the log itself, so a
commit has nothing to publish before its index transaction and nothing to catch up on
(engine/store/core.py ``CommitLog``; the bucket's log is engine/store/commit/bucket.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..unlisted import delete_unlisted

if TYPE_CHECKING:
    from ...api import RepairReport
    from ...format.commitdoc import CommitDoc
    from ..core import PackStoreState


class LocalLog:
    publishes = False

    def __init__(self, url: str) -> None:
        self.url = url

    def attach(self, core: PackStoreState, *, create: bool) -> RepairReport | None:
        return None

    def seq(self, core: PackStoreState) -> int:
        return 0

    def catch_up(self, core: PackStoreState) -> int:
        return 0

    def refresh(self, core: PackStoreState) -> None:
        return None

    def rebuild(self, core: PackStoreState) -> RepairReport:
        raise AssertionError("a local store's index is rebuilt from its packs (repair)")

    def publish(self, core: PackStoreState, base: int, doc: Callable[[], CommitDoc]) -> int | None:
        return None  # the index transaction is the commit

    def check_age(self, started: float) -> None:
        return None  # no other cache deletes this store's unlisted packs

    def begin_gc(self, core: PackStoreState) -> None:
        return None

    def settle_gc(self, core: PackStoreState, seq: int | None) -> None:
        return None

    def delete_unlisted(self, core: PackStoreState, live_packs: set[int]) -> int:
        return len(delete_unlisted(core, live_packs, core.storage.sizes()))

"""The coordinator's index, opened on a thread while the store's gloo groups are made
(cnrstore/distributed/store.py): a cold index open and the groups' rendezvous each took a
few milliseconds of a restore's open, one after the other."""

from __future__ import annotations

from typing import Any

from cnrstore.codec.cores import start_thread
from cnrstore.core.store import open as open_plain

__all__ = ["IndexOpening"]


class IndexOpening:
    """The coordinator's plain store, opened on a thread of its own (``result()`` joins
    it; ``discard()`` closes what it opened)."""

    def __init__(self, path: Any, options: Any, kwargs: dict):
        self._box: list = []

        def run() -> None:
            try:
                self._box.append(("ok", open_plain(path, options, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - raised by result()
                self._box.append(("err", exc))

        self._thread = start_thread(run, "cnr-open-index")

    def result(self) -> Any:
        self._thread.join()
        kind, value = self._box[0]
        if kind == "err":
            raise value
        return value

    def discard(self) -> None:
        try:
            self.result().close()
        except BaseException:  # noqa: BLE001 - the open's own failure is not the error
            pass

"""Progress of a long API call (put, get, load, gc, verify) for an opt-in ``progress=``
callback: ``progress(done, total)``, ``done`` never decreasing, ending with one call of
``done == total`` when the call completed (for a non-blocking put: when it committed).

Puts and gets count the bytes of the tables they handle; gc and verify, whose engine passes
report in their own units, count thousandths of their work. A call whose work is under the
handle's ``progress_min_bytes`` (cnrstore.Options) reports nothing: short calls stay quiet.
The callback may be ``cnrstore.tools.progress.Progress`` (the CLI's bar, one reporter for
both) or anything taking two ints; it runs on the thread doing the work (a decode or the
writer thread), one call at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from cnrstore.errors import InvalidType

__all__ = ["Reporter", "check_progress"]


def check_progress(progress: object) -> Callable[[int, int], None] | None:
    """``progress`` checked before any work: None or a callable, else InvalidType."""
    if progress is not None and not callable(progress):
        raise InvalidType(f"progress must be None or a callable (done, total), got "
                          f"{type(progress).__name__}")
    return progress


class Reporter:
    """Monotone (done, total) to ``fn``; silent when ``fn`` is None or ``total`` is under
    ``min_total``. ``add`` reports work done short of the total; only ``finish`` reports
    ``done == total``, once."""

    def __init__(self, fn: Callable[[int, int], None] | None, total: int, *,
                 min_total: int):
        self.fn = fn if fn is not None and total >= max(min_total, 1) else None
        self.total = total
        self.done = 0
        self._added = 0
        self._lock = threading.Lock()
        self._finished = False

    def add(self, n: int) -> None:
        """``n`` more units done (from any thread)."""
        if self.fn is not None:
            self._report(lambda: self._added + n)

    def to(self, done: int) -> None:
        """``done`` units done in all, if that moved forward."""
        if self.fn is not None:
            self._report(lambda: done)

    def _report(self, new: Callable[[], int]) -> None:
        assert self.fn is not None
        with self._lock:
            done = new()
            self._added = done
            if done <= self.done or done >= self.total or self._finished:
                self.done = max(self.done, min(done, self.total))
                return
            self.done = done
            self.fn(done, self.total)

    def phase(self, k: int, n: int) -> Callable[[int, int], None]:
        """An engine ProgressFn for phase ``k`` of ``n``, mapped onto this reporter."""
        def tick(done: int, total: int) -> None:
            if total > 0:
                self.to((self.total * k + self.total * min(done, total) // total) // n)
        return tick

    def finish(self) -> None:
        if self.fn is None:
            return
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self.done = self.total
            self.fn(self.total, self.total)

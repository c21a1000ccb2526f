"""The one progress reporter of cnrstore: a one-line bar on stderr for the tools, the
``cnrstore`` command and the demo.

It is an engine ``ProgressFn`` (``bar(done, total)``), so every long operation that takes a
``progress=`` callback draws through it; ``update(done, note)`` serves loops that know their
total up front (the demo's training runs). It draws at most ten times a second, and only
when ``enabled`` (callers enable it when stderr is a terminal), so scripts and logs get no
control characters. On exit it erases its line, or with ``keep=True`` ends it, so the last
state stays on screen.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 30


class Progress:
    def __init__(self, label: str, *, enabled: bool, total: int = 0, keep: bool = False,
                 stream: TextIO | None = None):
        self.label = label
        self.enabled = enabled
        self.total = total
        self.keep = keep
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done != total:
            return
        self._last = now
        if total > 0:
            frac = min(max(done / total, 0.0), 1.0)
            bar = "#" * int(frac * _WIDTH)
            text = f"{self.label} [{bar:<{_WIDTH}}] {frac:6.1%} {done}/{total}"
        else:
            text = f"{self.label} {done}"
        self.stream.write("\r" + text + (f"  {note}" if note else "") + "\033[K")
        self.stream.flush()
        self._drawn = True

    def update(self, done: int, note: str = "") -> None:
        """Progress against the ``total`` given at construction, with a short note."""
        self(done, self.total, note)

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n" if self.keep else "\r\033[K")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

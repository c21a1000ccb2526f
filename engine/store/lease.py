"""Leases on reserved pack numbers (docs/FORMAT.md "Distributed commit").

While a distributed put is in flight, its ranks write sealed packs that no index lists
yet; to gc they look exactly like crash leftovers. ``reserve_packs`` therefore takes a
lease on the range: an empty file ``<store>/leases/<start>-<stop>.lease`` that the
reserving handle keeps ``flock``-ed until the put commits, fails, or the handle closes.
gc and repair (under the writer lock) treat a lease whose file is still locked as live:
its packs are neither deleted nor dropped, and repair keeps ``next_pack`` past it. The
kernel drops the lock when the reserving process dies, so a crashed put's packs become
ordinary orphans for the next gc, with no timeout to tune and no clock to trust.

The lease directory lives beside the index, on the coordinator's local disk, where every
process that may run gc or repair on the store also runs (LMDB is never shared across
hosts); flock is only asked for there. For a bucket or shared-directory store that is the
coordinator's cache: its leases spare rank packs from a gc on that cache only. A gc on
any other cache spares them by its grace period instead (unlisted packs younger than
``gc_grace_s`` are kept; docs/FORMAT.md "Distributed commit on a bucket or a shared
directory").
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import re
import threading

from ..errors import StoreError
from ..fs.fileio import makedirs_durable

LEASE_DIR = "leases"
_NAME = re.compile(r"^([0-9]{10})-([0-9]{10})\.lease$")


def _lease_path(root: pathlib.Path, packs: range) -> pathlib.Path:
    return root / LEASE_DIR / f"{packs.start:010d}-{packs.stop:010d}.lease"


class Leases:
    """The leases one store handle holds."""

    def __init__(self, root: pathlib.Path) -> None:
        self._root = root
        self._held: dict[range, int] = {}
        self._lock = threading.Lock()

    def take(self, packs: range) -> None:
        """Create and lock the lease file of ``packs`` (call before the reservation
        commits: a crash in between leaves a stale file, harmless)."""
        path = _lease_path(self._root, packs)
        makedirs_durable(path.parent)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(f"lease {path.name} is held by another process") from None
        with self._lock:
            self._held[packs] = fd

    def release(self, packs: range) -> bool:
        """Drop the lease of exactly ``packs``; False when this handle holds none."""
        with self._lock:
            fd = self._held.pop(packs, None)
        if fd is None:
            return False
        try:
            _lease_path(self._root, packs).unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)  # closing the last descriptor drops the flock
        return True

    def release_covering(self, numbers: set[int]) -> None:
        """Drop every lease that holds one of the pack ``numbers``."""
        with self._lock:
            ranges = [r for r in self._held if any(n in r for n in numbers)]
        for r in ranges:
            self.release(r)

    @property
    def held(self) -> list[range]:
        with self._lock:
            return list(self._held)

    def close(self) -> None:
        for r in self.held:
            self.release(r)


def live_ranges(root: pathlib.Path, *, clean: bool = True) -> list[range]:
    """The ranges of leases whose holder is alive (its flock still held). With ``clean``,
    stale lease files (holder dead) are deleted; call that only under the writer lock."""
    d = root / LEASE_DIR
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    live = []
    for name in sorted(names):
        m = _NAME.match(name)
        if not m:
            continue
        packs = range(int(m.group(1)), int(m.group(2)))
        try:
            fd = os.open(d / name, os.O_RDONLY)
        except FileNotFoundError:
            continue  # released meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(packs)
                continue
            if clean:
                try:
                    os.unlink(d / name)
                except FileNotFoundError:
                    pass
        finally:
            os.close(fd)
    return live


def leased(root: pathlib.Path) -> set[int]:
    """Pack numbers under a live lease (cleans stale lease files: writer lock held)."""
    return {n for r in live_ranges(root) for n in r}

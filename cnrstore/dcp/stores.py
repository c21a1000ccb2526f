"""Stores that DCP writers and readers open from a path, kept open between saves and
loads of this process (docs/design/dcp-speed.md).

Opening a store for every save cost the save its diff bases (each later save seeded them
again from the stored step: reading and fingerprinting the blocks it was about to
overwrite) and an open of the index and two gloo groups, on every rank, twice per load
(read_metadata and read_data). So the store a path opens stays open, keyed by the path,
the group and the open options, and the next save or load of the same key takes it back
(``checkout``) as long as nothing else touched the store meanwhile:

- the coordinator (the one process without a group) compares the store's step roots with
  the roots it left there (those it found plus the step it committed) and the identity
  (device, inode) of the store directory and of its index file with those it opened: a
  step put, deleted or rolled back by any other handle or process, a directory removed
  and made again, or an index rebuilt, and the store is closed and opened afresh, exactly
  as before; its verdict reaches every rank in one round, so every rank decides alike;
- one save or load at a time holds a store: another thread asking for the same key
  waits for it (DCP's own collectives allow one call per process group at a time);
- a default process group made anew (init_process_group after destroy), or another
  process (a fork), never sees the old handle; ``close_stores()`` closes them all (also
  done at exit), e.g. before a directory is removed.

Stores on S3 or on a shared directory (``cache_dir=``) are not kept: their index is a
cache of the bucket that only an open brings up to date with other writers.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch.distributed as dist

from cnrstore.core.location import is_url
from cnrstore.errors import CheckpointError
from cnrstore.format.manifest import ROOT_PREFIX

__all__ = ["checkout", "checkin", "close_stores", "cacheable"]

_lock = threading.Condition()
_entries: dict[tuple, _Entry] = {}


class _Entry:
    def __init__(self, store: Any, world: Any, group: Any, ident: Any) -> None:
        self.store = store
        self.world = world      # the default process group it was opened under (kept alive)
        self.group = group
        self.pid = os.getpid()
        self.ident = ident      # coordinator: the directory and index file opened
        self.roots: dict | None = None  # coordinator: the roots it left; None: unknown
        self.busy = False


def cacheable(path: str, open_kwargs: dict[str, Any]) -> bool:
    return not is_url(path) and open_kwargs.get("cache_dir") is None


def _key(path: str, group: Any, open_kwargs: dict[str, Any]) -> tuple:
    return (os.path.realpath(path), id(group), repr(sorted(open_kwargs.items())))


def _identity(path: str) -> tuple | None:
    try:
        d = os.stat(path)
        f = os.stat(os.path.join(path, "index", "data.mdb"))
    except OSError:
        return None
    return (d.st_dev, d.st_ino, f.st_dev, f.st_ino)


def _coordinator_objects(store: Any) -> Any:
    """The engine store of the coordinator's (or the one process's) handle, else None."""
    local = getattr(store, "local", store) if hasattr(store, "comm") else store
    return None if local is None else local.objects


def _steps(objects: Any) -> dict[str, bytes]:
    """The step roots (what the diff bases hang on; the options root is written once)."""
    return {n: r for n, r in objects.roots().items() if n.startswith(ROOT_PREFIX)}


def _world() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _usable(e: _Entry, group: Any) -> bool:
    """What every rank sees alike: the same process, default group and group object."""
    if e.pid != os.getpid() or e.world is not _world() or e.group is not group:
        return False
    comm = getattr(e.store, "comm", None)
    return not getattr(e.store, "closed", False) and (comm is None or comm.broken is None)


def _close(e: _Entry) -> None:
    if e.pid != os.getpid():
        return  # a forked child: the handle is its parent's
    try:
        e.store.close()
    except Exception:  # noqa: BLE001 - a broken handle is dropped anyway
        pass


def checkout(path: str, group: Any, open_kwargs: dict[str, Any], opener: Any) -> Any:
    """The store at ``path`` for one save or load: the one kept from the last, if nothing
    else touched the store since (collective with a group), else ``opener()``'s."""
    key = _key(path, group, open_kwargs)
    with _lock:
        e = _entries.get(key)
        if e is not None and not _usable(e, group):
            del _entries[key]
            _close(e)
            e = None
        if e is not None:
            held = e
            timeout = getattr(getattr(held.store, "comm", None), "timeout", 300.0)
            if not _lock.wait_for(lambda: not held.busy, timeout):
                raise CheckpointError(f"the store at {path} stayed in use by another save "
                                      f"or load of this process for {timeout:g} s")
            if _entries.get(key) is not e:  # closed meanwhile (close_stores)
                e = None
            else:
                e.busy = True
    if e is not None:
        try:
            fresh = _agree(e, path)
        except BaseException:
            _release(key, e, drop=True)
            raise
        if fresh:
            return e.store
        _release(key, e, drop=True)
    store = opener()
    objects = _coordinator_objects(store)
    e = _Entry(store, _world(), group, _identity(path) if objects is not None else None)
    if objects is not None:
        e.roots = _steps(objects)
    e.busy = True
    with _lock:
        old = _entries.pop(key, None)
        _entries[key] = e
    if old is not None and old is not e:
        _close(old)
    return store


def _agree(e: _Entry, path: str) -> bool:
    """Whether the kept store is as this process left it (the coordinator's verdict)."""
    def check(objects: Any) -> bool:
        return (e.roots is not None and e.ident is not None and _identity(path) == e.ident
                and _steps(objects) == e.roots)

    store = e.store
    if hasattr(store, "coordinated"):  # a DistributedStore: one round, every rank alike
        return bool(store.coordinated("dcp: reuse", lambda s: check(s.objects)))
    return check(store.objects)


def checkin(store: Any, wrote: tuple[str, bytes] | None = None) -> None:
    """The save or load is over: ``store`` is free for the next. ``wrote``: the root the
    save committed (name, id); any other change to the roots since the checkout means
    another writer came by, and the next checkout opens afresh."""
    with _lock:
        found = next(((k, e) for k, e in _entries.items() if e.store is store), None)
    if found is None:
        return
    key, e = found
    objects = _coordinator_objects(store)
    if objects is not None and e.roots is not None:
        expected = dict(e.roots)
        if wrote is not None:
            expected[wrote[0]] = wrote[1]
        try:
            now = _steps(objects)
        except Exception:  # noqa: BLE001 - unknown: open afresh next time
            now = None
        e.roots = now if now == expected else None
    _release(key, e, drop=False)


def _release(key: tuple, e: _Entry, *, drop: bool) -> None:
    with _lock:
        e.busy = False
        if drop and _entries.get(key) is e:
            del _entries[key]
        _lock.notify_all()
    if drop:
        _close(e)


def close_stores() -> None:
    """Close every store kept open by DCP writers and readers of this process (the next
    save or load of a path opens it again). Collective where a store has a group: every
    rank calls it (a store with a save still in flight is waited for)."""
    with _lock:
        _lock.wait_for(lambda: not any(e.busy for e in _entries.values()))
        entries = list(_entries.values())
        _entries.clear()
    for e in entries:
        _close(e)

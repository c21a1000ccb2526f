"""Where the ``cnrstore`` command finds a store: a directory store, a store on a shared
directory or on S3 (both with their index in a local cache: ``--cache-dir`` or
$CNRSTORE_CACHE_DIR), opened read-only for the views where it can be.

Kept apart from app.py so the parser stays small; nothing here imports torch (the views
must start without it: tests/test_cli_imports.py)."""

from __future__ import annotations

import argparse
import os

from cnrstore.errors import UsageError

__all__ = ["CACHE_ENV", "cache_dir_of", "gc_grace_of", "is_shared", "is_url", "open_objects",
           "open_store", "require_store"]

# The index cache of a store on S3 or on a shared directory, when --cache-dir is not given.
CACHE_ENV = "CNRSTORE_CACHE_DIR"


def is_url(path: str) -> bool:
    return path.startswith("s3://")


def is_shared(path: str) -> bool:
    # A shared-directory store has the engine's MARK directory (commits/), never index/.
    from engine.storage.shared import MARK

    return (os.path.isdir(os.path.join(path, MARK))
            and not os.path.exists(os.path.join(path, "index")))


def cache_dir_of(args: argparse.Namespace) -> str | None:
    """--cache-dir, else $CNRSTORE_CACHE_DIR for the stores that keep their index in a
    cache (a directory store holds its own: the variable never applies to it)."""
    if args.cache_dir:
        return str(args.cache_dir)
    store = getattr(args, "store", "")
    if store and (is_url(store) or is_shared(store)):
        return os.environ.get(CACHE_ENV) or None
    return None


def require_store(path: str, cache_dir: str | None = None) -> None:
    # The engine's layout (engine/store/packstore.py): a store directory holds index/ and packs/.
    # Checked here so a mistyped path is a usage error, and nothing is created. A bucket
    # store is checked by its open (create=False: "no store at s3://...").
    where = "on S3" if is_url(path) else "on a shared directory"
    if (is_url(path) or is_shared(path)) and not cache_dir:
        raise UsageError(f"{path}: a store {where} needs --cache-dir DIR (a local "
                         f"directory for its index) or ${CACHE_ENV}")
    if is_url(path):
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"no store at {path!r}: it is a file, not a store directory")
    if not os.path.isdir(path):
        raise UsageError(f"no store at {path!r} (directory not found)")
    if not any(os.path.exists(os.path.join(path, d)) for d in ("index", "packs")):
        raise UsageError(f"no store at {path!r} (no index/ or packs/ inside)")


def gc_grace_of(path: str) -> float | None:
    """The gc grace period of the store at ``path`` as the command opens it (with no
    storage_options: the engine's default), None for a directory store (no grace)."""
    if is_url(path):
        from engine.storage.s3 import TUNING
    elif is_shared(path):
        from engine.storage.shared import TUNING
    else:
        return None
    return float(TUNING["gc_grace_s"])


def _stale(exc: BaseException) -> bool:
    from engine import StaleIndex

    return isinstance(exc, StaleIndex) or isinstance(exc.__cause__, StaleIndex)


def open_objects(path: str, cache_dir: str | None = None):
    """The engine store at ``path`` for a read-only view: opened read-only (no writer lock,
    no writes: a store that cannot be written can still be inspected). An index behind its
    packs cannot be brought up to date read-only; where the store is writable it is then
    opened writable to do so. A bucket store's cache is brought up to date on open, so it
    opens writable (its cache is local; the bucket is only read)."""
    import engine

    require_store(path, cache_dir)
    if cache_dir:
        from cnrstore.core.location import open_objects as open_engine

        return open_engine(path, cache_dir=cache_dir, create=False)
    try:
        return engine.open(path, create=False, readonly=True)
    except engine.StaleIndex:
        if not os.access(path, os.W_OK):
            raise
    return engine.open(path, create=False)


def open_store(path: str, *, create: bool = False, readonly: bool = False,
               cache_dir: str | None = None):
    """The checkpoint store at ``path`` (the store API, for commands that need it)."""
    from cnrstore.core.store import open as open_checkpoints

    if not create or is_url(path):
        require_store(path, cache_dir)
    if cache_dir or is_url(path):
        return open_checkpoints(path, create=create, cache_dir=cache_dir)
    if readonly:
        try:
            return open_checkpoints(path, create=False, readonly=True)
        except Exception as exc:  # StaleIndex, or what the store translated it into
            if not _stale(exc) or not os.access(path, os.W_OK):
                raise
    return open_checkpoints(path, create=create)

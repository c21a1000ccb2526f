"""A store on a directory that every host reaches (NFS, Lustre): a "bucket" made of files,
with its LMDB index as a local cache exactly as for S3 (docs/FORMAT.md "Shared
directories").

LMDB must never live on a network filesystem (lmdb.h), so the shared directory holds only
what a bucket holds, and the commit protocol is the bucket's (engine/store/commit/bucket.py):

    <shared>/packs/XX/NNNNNNNN.pack   immutable packs, the same bytes as a directory store's
    <shared>/claims/NNNNNNNN          empty, created create-only before pack N is written:
                                      two writers on two caches never pick one number
    <shared>/commits/SSSS...S         one msgpack commit document each (20 digits)

Create-only is a hard link (``DirectoryBackend.put_if_absent``): the object is written to
a temp file beside its name, fsync'ed, and ``link``ed to its final name (EEXIST when
another writer made it first; ``link`` is atomic on NFS and Lustre, where O_EXCL over
NFSv2 was not), then the directory is fsync'ed. A crash leaves either no object or a
whole one, plus at worst a temp file that no listing reads. Packs are written in place,
fsync'ed with their directory before any commit names them (as in a directory store).

obstore's LocalStore has a create mode but never fsyncs: not enough for checkpoints.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

from ..errors import FormatError, NoStore
from ..fs.fileio import makedirs_durable
from .local import DirectoryBackend

MARK = "commits"  # a shared-directory store has this directory; a directory store never
# MARK first: another process opening the store while this one creates it sees an empty
# directory or one with MARK, never a directory that looks like someone else's.
_DIRS = (MARK, "packs", "claims")
TUNING = {"gc_grace_s": 21600.0}


class SharedBackend(DirectoryBackend):
    """The objects of the shared directory ``root`` (packs, claims, commit documents).
    Reads use ``pread`` (``remote`` stays False: a mounted file is not a ranged request);
    writers on other hosts write here too (``shared``)."""

    shared = True

    def __init__(self, root: pathlib.Path) -> None:
        super().__init__(pathlib.Path(root).absolute())
        self.url = os.fspath(self.root)

    def locator(self) -> tuple[str, str]:
        return ("shared", self.url)

    def describe(self) -> str:
        return self.url


def check_location(root: pathlib.Path, cache: pathlib.Path, *, create: bool) -> None:
    """Refuse what must never be mixed: a directory store (its index inside it) opened as
    a shared one, a non-store directory, and a cache inside the shared directory."""
    if cache == root or root in cache.parents:
        raise FormatError(f"cache_dir {cache} lies inside the shared store {root}: the "
                          "index cache must be on a local disk, outside it")
    if not root.exists():
        if not create:
            raise NoStore(f"no store at {root} (pass create=True to make one)")
        return
    if not root.is_dir():
        raise FormatError(f"{root} is not a directory")
    entries = {e.name for e in root.iterdir()}
    if entries & {"index", "index.new", "lock"}:
        raise FormatError(f"{root} is a directory store with its own index: open it "
                          "without cache_dir (a shared-directory store is made by "
                          "opening an empty or new directory with cache_dir)")
    if entries and MARK not in entries:
        raise FormatError(f"{root} is a non-empty directory that is not a cnrstore store")
    if not entries and not create:
        raise NoStore(f"no store at {root} (pass create=True to make one)")


def attach_shared(root: pathlib.Path, cache: pathlib.Path,
                  storage_options: Mapping[str, Any] | None, *, create: bool
                  ) -> tuple[SharedBackend, dict[str, float]]:
    """The shared directory ``root`` (made when ``create``; refused when it holds
    something else, or when ``cache`` lies inside it) as a backend, and its tuning
    (``storage_options`` may set ``gc_grace_s`` only)."""
    given = dict(storage_options or {})
    unknown = sorted(set(given) - set(TUNING))
    if unknown:
        raise FormatError(f"storage_options {unknown} do not apply to a shared-directory "
                          f"store (it takes {sorted(TUNING)})")
    tuning = {k: float(given.get(k, v)) for k, v in TUNING.items()}
    check_location(root, cache, create=create)
    makedirs_durable(root)
    for d in _DIRS:
        makedirs_durable(root / d)
    return SharedBackend(root), tuning

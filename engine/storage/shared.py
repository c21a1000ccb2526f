"""A store on a directory that every host reaches (NFS, Lustre): a "bucket" made of files,
with its LMDB index as a local cache exactly as for S3 (docs/FORMAT.md "Shared
directories").

LMDB must never live on a network filesystem (lmdb.h), so the shared directory holds only
what a bucket holds, and the commit protocol is the bucket's (engine/store/commit/bucket.py):

    <shared>/packs/XX/NNNNNNNN.pack   immutable packs, the same bytes as a directory store's
    <shared>/claims/NNNNNNNN          empty, created O_EXCL before pack N is written: two
                                      writers on two caches never pick one number
    <shared>/commits/SSSS...S         one msgpack commit document each (20 digits)

Create-only is a hard link: the document is written to a temp file in ``commits/``,
fsync'ed, and ``link``ed to its final name (EEXIST when another writer made it first;
``link`` is atomic on NFS and Lustre, where O_EXCL over NFSv2 was not), then the
directory is fsync'ed. A crash leaves either no document or a whole one, plus at worst a
temp file that no listing reads. Packs are written in place, fsync'ed with their
directory before any commit names them (as in a directory store).

obstore's LocalStore has a create mode but never fsyncs: not enough for checkpoints.
"""

from __future__ import annotations

import os
import pathlib
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from ..errors import FormatError, NoStore
from ..format.names import list_pack_files
from ..fs.fileio import fsync_dir, makedirs_durable, write_all
from .base import WritablePack
from .local import LocalSink, LocalStorage

MARK = "commits"  # a shared-directory store has this directory; a directory store never
# MARK first: another process opening the store while this one creates it sees an empty
# directory or one with MARK, never a directory that looks like someone else's.
_DIRS = (MARK, "packs", "claims")
TUNING = {"gc_grace_s": 21600.0}


class SharedStorage(LocalStorage):
    """Packs and commit documents of the shared directory ``root``. Reads use ``pread``
    (``remote`` stays False: a mounted file is not a ranged request)."""

    def __init__(self, root: pathlib.Path, staging: pathlib.Path) -> None:
        super().__init__(pathlib.Path(root).absolute())
        self.url = os.fspath(self.root)
        self.staging = staging  # unused (packs are written in place); Remote expects it

    def locator(self) -> tuple[str, str]:
        return ("shared", self.url)

    def _file(self, key: str) -> pathlib.Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise FormatError(f"bad object key {key!r}")
        return self.root / key

    # -- plain objects (claims, commits), as S3Storage has them ---------------------------
    def get(self, key: str, *, limit: int | None = None) -> bytes:
        """The file ``key`` (FileNotFoundError when there is none), at most ``limit + 1``
        bytes of it: a sparse file may claim any size."""
        with open(self._file(key), "rb") as f:
            if limit is None:
                return f.read()
            # read(n) allocates n bytes up front: ask for no more than the file holds.
            return f.read(min(os.fstat(f.fileno()).st_size, limit) + 1)

    def put_create(self, key: str, data: bytes) -> None:
        """Create ``key`` durably, only if absent; FileExistsError otherwise."""
        path = self._file(key)
        makedirs_durable(path.parent)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise FileExistsError(f"{key} already exists in {self.url}") from None
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        fsync_dir(path.parent)

    def listing(self, prefix: str, *, after: str | None = None
                ) -> list[tuple[str, int, datetime]]:
        """(key, size, last modified) of every file under ``prefix``, in key order (temp
        files of an unfinished ``put_create`` excluded)."""
        base = self._file(prefix.rstrip("/"))
        out = []
        for dirpath, subdirs, names in os.walk(base):
            subdirs.sort()
            rel = pathlib.Path(dirpath).relative_to(self.root).as_posix()
            for name in names:
                if name.startswith("."):
                    continue
                key = f"{rel}/{name}"
                if after is not None and key <= after:
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted meanwhile
                out.append((key, st.st_size,
                            datetime.fromtimestamp(st.st_mtime, tz=timezone.utc)))
        return sorted(out)

    def delete_key(self, key: str) -> None:
        path = self._file(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        fsync_dir(path.parent)

    # -- packs ----------------------------------------------------------------------------
    def create(self, n: int, *, meta: bool) -> WritablePack:
        return SharedSink(self, n)

    def pack_listing(self) -> dict[int, tuple[int, datetime]]:
        """Every pack file: number -> (size, last modified)."""
        out = {}
        for n, path in list_pack_files(self.root).items():
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            out[n] = (st.st_size, datetime.fromtimestamp(st.st_mtime, tz=timezone.utc))
        return out

    def describe(self) -> str:
        return self.url


class SharedSink(LocalSink):
    """A pack written in place, its number claimed first (O_EXCL on ``claims/N``, kept
    for ever: a number gc freed is never reused, so a stale location can never meet
    another pack's bytes)."""

    def __init__(self, storage: SharedStorage, n: int) -> None:
        claim = storage.root / "claims" / f"{n:08d}"
        makedirs_durable(claim.parent)
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # FileExistsError
        os.close(fd)
        self._claims = claim.parent
        super().__init__(storage.path(n))

    def finish(self) -> None:
        super().finish()
        fsync_dir(self._claims)  # the pack's own directory: PackSet / PackSink fsync it


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
                  ) -> tuple[SharedStorage, dict[str, float]]:
    """The shared directory ``root`` (made when ``create``; refused when it holds
    something else) as a storage whose uploads stage in ``cache``, and its tuning
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
    return SharedStorage(root, cache / "staging"), tuning

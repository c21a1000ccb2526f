"""Where a store's objects live, as keys and bytes (engine/storage/base.py): a local
directory (``DirectoryBackend``), a directory every host reaches
(``engine.storage.shared``), an S3 bucket (``engine.storage.s3``, needs the optional
``obstore``; imported only when used) or memory (``engine.storage.memory``). Backends know
nothing of packs, the index or the store: engine/packs/storage.py maps pack numbers to
keys. The LMDB index always stays on a local disk (docs/FORMAT.md "Object stores",
"Shared directories")."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

from ..errors import FormatError
from .base import KeyInfo, KeyWriter, ObjectBackend
from .local import DirectoryBackend, FileWriter

__all__ = ["DirectoryBackend", "FileWriter", "KeyWriter", "ObjectBackend", "KeyInfo",
           "attach"]


def attach(locator: tuple[str, str], *, staging: str | os.PathLike,
           storage_options: Mapping[str, Any] | None = None) -> ObjectBackend:
    """The backend an ``ObjectBackend.locator()`` names, reached from this process without
    an index (a rank of a distributed put): objects it writes to a bucket are staged in
    ``staging`` (an existing directory of this process's own); the client is configured
    from this process's AWS_* environment and ``storage_options``."""
    try:
        kind, where = locator
    except (TypeError, ValueError):
        raise FormatError(f"malformed storage locator {locator!r}") from None
    if kind == "dir":
        return DirectoryBackend(pathlib.Path(where))
    if kind == "shared":
        from .shared import SharedBackend

        return SharedBackend(pathlib.Path(where))
    if kind == "s3":
        from .s3 import attach_bucket

        return attach_bucket(where, pathlib.Path(staging), storage_options)[0]
    raise FormatError(f"unknown kind of storage {kind!r}")

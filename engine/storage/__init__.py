"""Where pack files live: a local directory (``LocalStorage``), a directory every host
reaches (``engine.storage.shared``) or an S3 bucket (``engine.storage.s3``, needs the
optional ``obstore``; imported only when used).

The engine reads and writes packs only through a ``PackStorage``; the LMDB index always
stays on a local disk (docs/FORMAT.md "Object stores", "Shared directories")."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

from ..errors import FormatError
from .base import PackStorage, WritablePack
from .local import LocalSink, LocalStorage

__all__ = ["LocalSink", "LocalStorage", "WritablePack", "PackStorage", "attach"]


def attach(locator: tuple[str, str], *, staging: str | os.PathLike,
           storage_options: Mapping[str, Any] | None = None) -> PackStorage:
    """The packs a ``PackStorage.locator()`` names, reached from this process without an
    index (a rank of a distributed put): packs it writes to a bucket are staged in
    ``staging`` (an existing directory of this process's own); the client is configured
    from this process's AWS_* environment and ``storage_options``."""
    try:
        kind, where = locator
    except (TypeError, ValueError):
        raise FormatError(f"malformed storage locator {locator!r}") from None
    if kind == "dir":
        return LocalStorage(pathlib.Path(where))
    if kind == "shared":
        from .shared import SharedStorage

        return SharedStorage(pathlib.Path(where), pathlib.Path(staging))
    if kind == "s3":
        from .s3 import attach_bucket

        return attach_bucket(where, pathlib.Path(staging), storage_options)[0]
    raise FormatError(f"unknown kind of pack storage {kind!r}")

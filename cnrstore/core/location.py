"""Where a store lives: a directory, or ``s3://bucket/prefix`` or a shared directory with
a local index cache.

``cnrstore.open`` asks ``open_objects`` for the engine store, so a new kind of location
is one branch here (docs/GUIDE.md "Stores on S3")."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import engine
from cnrstore.errors import InvalidInput, MissingExtra, engine_errors

SCHEMES = ("s3://",)


def is_url(path: object) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


def open_objects(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> engine.ObjectStore:
    """The engine store at ``path`` (``kwargs`` go to ``engine.open``). With ``cache_dir``
    the LMDB index is a rebuildable cache on that local disk and the packs live at
    ``path``: an ``s3://`` location (configured by the AWS_* environment variables,
    overridden by ``storage_options``) or a directory every host reaches (a shared
    filesystem; ``storage_options`` may set ``gc_grace_s``). Without it ``path`` is a
    directory store holding its own index."""
    if not is_url(path):
        if cache_dir is None:
            if storage_options:
                raise InvalidInput("storage_options are for stores opened with cache_dir= "
                                   f"(s3:// or a shared directory); {os.fspath(path)!r} "
                                   "is opened as a directory store")
            return engine.open(path, **kwargs)  # errors as cnrstore.open always raised them
        with engine_errors():
            return engine.storage_open(os.fspath(path), cache_dir=cache_dir,
                                       storage_options=dict(storage_options or {}), **kwargs)
    if cache_dir is None:
        raise InvalidInput(f"{path}: a store on S3 needs cache_dir= (a local directory "
                           "for its index)")
    try:
        import obstore  # noqa: F401
    except ImportError as exc:
        raise MissingExtra("s3:// stores need obstore: pip install 'cnrstore[s3]'") from exc
    with engine_errors():
        return engine.storage_open(str(path), cache_dir=cache_dir,
                                   storage_options=dict(storage_options or {}), **kwargs)

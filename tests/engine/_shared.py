"""Shared-directory stores for the tests: the "bucket" is a directory (on a real cluster
an NFS or Lustre mount every host reaches), each store handle caches its index in a
directory of its own, as each host would on its local disk.

``SharedDirs`` mirrors ``_s3.MotoS3`` (``url``, ``options``, ``store``), so a test of the
bucket protocol runs unchanged on both."""

from __future__ import annotations

import itertools
import os
import pathlib

import engine


class SharedDirs:
    def __init__(self, base: os.PathLike | str) -> None:
        self.base = pathlib.Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self._n = itertools.count()

    @property
    def options(self) -> dict:
        return {"gc_grace_s": 0.0}

    def url(self, prefix: str | None = None) -> str:
        return os.fspath(self.base / (prefix or f"shared{next(self._n)}"))

    def store(self, cache: os.PathLike | str, url: str | None = None, **kwargs):
        opts = dict(self.options, **kwargs.pop("storage_options", {}))
        return engine.storage_open(url or self.url(), cache_dir=pathlib.Path(cache),
                                   storage_options=opts, **kwargs)

    def stop(self) -> None:
        pass

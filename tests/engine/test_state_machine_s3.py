"""The engine state machine (engine/testing/machine.py) on a bucket store on moto S3: the
index cached locally, every other reopen on a fresh cache that rebuilds from the commit
documents alone."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from engine.testing import StoreMachine

_SETTINGS = dict(deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _machine(moto):
    class S3Machine(StoreMachine):
        real = True

        def open(self):
            if not hasattr(self, "caches"):
                self.caches = itertools.count()
                self.url = moto.url()
            n = next(self.caches)
            return moto.store(os.path.join(self.dir, f"cache{n // 2}"), self.url)

    return S3Machine


def test_s3_store_machine(moto_s3):
    run_state_machine_as_test(_machine(moto_s3), settings=settings(
        max_examples=5, stateful_step_count=15, **_SETTINGS))


@pytest.mark.slow
def test_s3_store_machine_long(moto_s3):
    run_state_machine_as_test(_machine(moto_s3), settings=settings(
        max_examples=100, stateful_step_count=40, **_SETTINGS))

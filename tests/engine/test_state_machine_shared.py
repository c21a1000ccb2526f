"""The engine state machine (engine/testing/machine.py) on a shared-directory store: packs and
commit documents in one directory, the index cached in another; every reopen takes a
fresh cache every other time, so the machine also checks that an empty cache rebuilds
exactly the committed state from the commit documents (and ``repair`` is that rebuild)."""

from __future__ import annotations

import itertools
import os

import pytest
from _helpers import pack_bytes
from hypothesis import HealthCheck, settings

import engine
from engine.testing import StoreMachine


class SharedMachine(StoreMachine):
    real = True

    def open(self):
        if not hasattr(self, "caches"):
            self.caches = itertools.count()
        n = next(self.caches)
        return engine.storage_open(os.path.join(self.dir, "shared"),
                                   cache_dir=os.path.join(self.dir, f"cache{n // 2}"),
                                   storage_options={"gc_grace_s": 0.0})

    def stored_bytes(self) -> int:
        return pack_bytes(os.path.join(self.dir, "shared"))


_SETTINGS = dict(deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TestSharedStoreMachine = SharedMachine.TestCase
TestSharedStoreMachine.settings = settings(max_examples=5, stateful_step_count=20,
                                           **_SETTINGS)


@pytest.mark.slow
def test_shared_store_machine_long():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        SharedMachine, settings=settings(max_examples=150, stateful_step_count=40,
                                         **_SETTINGS))

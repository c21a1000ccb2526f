"""The engine's state machine (engine/testing/machine.py) over the memory twin and the
pack store on real files and real LMDB in a temporary folder; test_state_machine_shared.py
runs it on a shared directory, test_state_machine_s3.py on S3 (moto)."""

from __future__ import annotations

import pytest
from _helpers import open_store, pack_bytes
from hypothesis import HealthCheck, settings

from engine.testing import StoreMachine

_SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class MemoryMachine(StoreMachine):
    real = False


class PackMachine(StoreMachine):
    real = True

    def open(self):
        return open_store(self.dir)

    def stored_bytes(self) -> int:
        return pack_bytes(self.dir)


TestMemoryStoreMachine = MemoryMachine.TestCase
TestMemoryStoreMachine.settings = settings(max_examples=25, stateful_step_count=20, **_SETTINGS)

TestPackStoreMachine = PackMachine.TestCase
# The default run keeps a short machine (the first run of a clean clone took 10 min 12 s,
# over its budget, and 12 examples took 26 s of a loaded 20-minute run at stop 41);
# test_pack_store_machine_long (-m slow) runs 300 examples.
TestPackStoreMachine.settings = settings(max_examples=6, stateful_step_count=20, **_SETTINGS)


@pytest.mark.slow
def test_pack_store_machine_long():
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(
        PackMachine, settings=settings(max_examples=300, stateful_step_count=40, **_SETTINGS)
    )

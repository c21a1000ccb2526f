"""The checkpoint state machine (test_state_machine.py) on a shared-directory store (packs
and commit documents in one directory, the index cached elsewhere): every reopen uses a
fresh cache every other time, so the machine also checks that an empty cache rebuilds
from the commit documents and sees exactly the kept steps."""

from __future__ import annotations

import itertools
import os

from ckpt_util import checkpoint_machine
from hypothesis import settings

import cnrstore

OPTS, CheckpointMachine = checkpoint_machine("cnr_checkpoint_state_machine_shared")


class SharedCheckpointMachine(CheckpointMachine):
    def open_store(self, *, seed: bool) -> cnrstore.CheckpointStore:
        if not hasattr(self, "caches"):
            self.caches = itertools.count()
        n = next(self.caches)
        return cnrstore.open(os.path.join(self.dir, "shared"),
                             cache_dir=os.path.join(self.dir, f"cache{n // 2}"),
                             storage_options={"gc_grace_s": 0.0}, seed_from_store=seed,
                             **OPTS)


SharedCheckpointMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CNR_SHARED_SM_EXAMPLES", "6")), stateful_step_count=15,
    deadline=None)
test_checkpoint_state_machine_shared = SharedCheckpointMachine.TestCase

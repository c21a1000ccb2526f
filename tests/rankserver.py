"""Where the tests' gloo ranks come from: forked from one server process that has imported
torch (and TorchRec, where installed) already.

Each rank is still a new process, with OMP_NUM_THREADS=1 as torchrun sets it, but it does
not import torch anew: a spawned rank spent most of its start-up there (1.5 s for torch,
4 s with TorchRec, on a quiet 2-core machine, far more on a loaded one), and the default
suite starts a few hundred ranks. The server imports the libraries with
OMP_NUM_THREADS=1, so their OpenMP runtime starts no threads a fork could break, and
imports nothing of cnrstore: each rank imports the code under test itself.
``CNR_SPAWN=1`` spawns fresh interpreters instead (to check a failure does not depend on
the server).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
from multiprocessing import forkserver

__all__ = ["context"]

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint"]
_started = False


def context():
    """The multiprocessing context the tests start their ranks in."""
    global _started
    if os.environ.get("CNR_SPAWN") == "1":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _started:
        preload = list(_PRELOAD)
        if importlib.util.find_spec("torchrec") is not None:
            preload.append("torchrec")
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment, read by its imports
        try:
            ctx.set_forkserver_preload(preload)
            forkserver.ensure_running()
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        _started = True
    return ctx

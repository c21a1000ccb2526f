"""The first use of the store API in a fresh process (issue 27, "the first put of a fresh
process, start-up included"): once torch is imported a process tracks ~10^6 objects, and
the allocations of importing cnrstore's modules used to set off a full (generation 2)
collection over all of them, ~0.1 s of the first ``open``. The lazy import pauses the
collector and restores its state, and so do the entry points users import directly
(``cnrstore.dcp``: 2 full collections before; ``cnrstore.distributed.torchrec``: 1).

Each case runs in a fresh interpreter, since a module imported once is not imported again.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

_PROBE = """
import gc, json, sys, time
import torch  # the objects a training process holds before it opens a store
disable = {disable!r}
if disable:
    gc.disable()
full = []
gc.callbacks.append(lambda phase, info: full.append(info["generation"])
                    if phase == "start" and info["generation"] == 2 else None)
import cnrstore
store = cnrstore.open(sys.argv[1])
store.put_tables(0, {{"t": torch.arange(64.0).reshape(8, 8)}}, quant="exact")
got = store.get_tables(0)["t"]
store.close()
print(json.dumps({{"full": len(full), "enabled": gc.isenabled(),
                   "same": bool(torch.equal(got, torch.arange(64.0).reshape(8, 8)))}}))
"""

_ENTRY = """
import gc, json
import torch
{pre}
full = []
gc.callbacks.append(lambda phase, info: full.append(info["generation"])
                    if phase == "start" and info["generation"] == 2 else None)
{entry}
print(json.dumps({{"full": len(full), "enabled": gc.isenabled()}}))
"""


def _run(code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _probe(tmp_path: pathlib.Path, *, disable: bool) -> dict:
    return _run(_PROBE.format(disable=disable), str(tmp_path / "store"))


def test_first_open_runs_no_full_collection(tmp_path: pathlib.Path) -> None:
    doc = _probe(tmp_path, disable=False)
    assert doc["same"]
    assert doc["full"] == 0  # before the pause: 1 (0.08-0.10 s on the 2-core VM)
    assert doc["enabled"]  # the collector runs again after the import


def test_a_disabled_collector_stays_disabled(tmp_path: pathlib.Path) -> None:
    doc = _probe(tmp_path, disable=True)
    assert doc["same"] and doc["full"] == 0
    assert not doc["enabled"]


@pytest.mark.parametrize(("pre", "entry"), [
    ("", "import cnrstore.dcp"),
    ("import torchrec", "from cnrstore.distributed import torchrec as ctr"),  # as a DMP's
])
def test_an_entry_point_imports_with_no_full_collection(pre: str, entry: str) -> None:
    if pre:
        pytest.importorskip("torchrec")
    doc = _run(_ENTRY.format(pre=pre, entry=entry))
    assert doc["full"] == 0
    assert doc["enabled"]

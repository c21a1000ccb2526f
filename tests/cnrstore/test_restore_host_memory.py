"""A restore to another device holds at most one table in host memory at a time, while a
CPU restore allocates all its outputs up front (restore.read_tables). Measured as the
peak RSS of a fresh process over its RSS before the restore (VmHWM after clear_refs;
ru_maxrss would include the parent's RSS at the fork)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import cnrstore

MIB = 1 << 20
_WORKER = r"""
import json, sys, torch, cnrstore

def status(key):  # bytes; VmHWM is this process's peak RSS since clear_refs
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path, device = sys.argv[1], sys.argv[2]
with cnrstore.open(path) as s:
    s.get_tables(1, rows={"t0": slice(0, 8)}, names=["t0"], device=device)  # warm up
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    got = s.get_tables(1, device=device)
    peak = status("VmHWM")
print(json.dumps({"growth": peak - before, "n": len(got)}))
"""


def _growth(path, device: str) -> int:
    out = subprocess.run([sys.executable, "-c", _WORKER, str(path), device], check=True,
                         capture_output=True, text=True, timeout=300)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["n"] == 4
    return res["growth"]


def _store(tmp_path):
    g = torch.Generator().manual_seed(0)
    with cnrstore.open(tmp_path / "s") as s:
        s.put_tables(1, {f"t{i}": torch.randn(64 * MIB // 256, 64, generator=g)
                         for i in range(4)})
    return tmp_path / "s"


def test_a_cpu_restore_holds_its_tables_once(tmp_path):
    path = _store(tmp_path)
    growth = _growth(path, "cpu")
    assert 3.5 * 64 * MIB < growth < 4 * 64 * MIB + 96 * MIB, growth / MIB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_restore_holds_one_table_on_the_host_at_a_time(tmp_path):
    path = _store(tmp_path)
    growth = _growth(path, "cuda")
    assert growth < 2 * 64 * MIB, growth / MIB  # all four at once would be 256 MiB

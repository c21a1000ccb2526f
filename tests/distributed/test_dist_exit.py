"""A non-blocking distributed put still queued when the ranks' interpreters exit is
committed, as a plain store's is (cnrstore/core/store.py closes open handles at exit):
a training script that ends right after its last ``put_tables(..., blocking=False)``
must not lose that checkpoint. The ranks are plain processes that exit normally (a
multiprocessing child leaves through os._exit and skips atexit, as no launcher does)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import torch
from dist_util import free_port

import cnrstore

ROOT = pathlib.Path(__file__).resolve().parents[2]

RANK = """
import os, sys, torch, torch.distributed as dist, cnrstore
rank, world, port, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
def table(step):
    return torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) * step
lo, hi = rank * 64 // world, (rank + 1) * 64 // world
s = cnrstore.open(path, group=dist.group.WORLD, block_rows=16, timeout=60)
s.put_tables(1, {"t": cnrstore.Shard(table(1)[lo:hi], row_offset=lo, rows=64)})
s.put_tables(2, {"t": cnrstore.Shard(table(2)[lo:hi], row_offset=lo, rows=64)},
             blocking=False)
print("queued", flush=True)
# No close, no wait: the script ends here.
"""


def test_a_queued_put_is_committed_when_the_ranks_exit(tmp_path):
    path = tmp_path / "store"
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), "2", port, str(path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "queued" in out
    with cnrstore.open(path) as s:
        assert s.steps() == [1, 2]
        want = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) * 2
        assert torch.equal(s.get_tables(2)["t"], want)
        assert s.verify().ok

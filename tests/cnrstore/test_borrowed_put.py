"""A blocking put of a whole exact table writes from the table itself (no staging copy,
docs/design/put-path.md, "A blocking put borrows the table"). The guarantee it keeps: the step
holds the values at call time, or it is not committed, even when the caller stops
waiting (Ctrl-C) and changes the table at once."""

from __future__ import annotations

import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import cnrstore
from tests.cnrstore.test_interrupt import _InterruptingJobs, _steps_within

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_blocking_exact_full_put_holds_no_copy_of_the_table(tmp_path):
    t = torch.randn(50_000, 16)
    with cnrstore.open(tmp_path / "s", create=True, block_rows=1024) as s:
        s.put_tables(1, {"t": t})
        assert s._core.buffers.held_bytes() == 0  # nothing staged for the pool
        assert torch.equal(s.get_tables(1)["t"], t)
        fut = s.put_tables(2, {"u": t}, blocking=False)  # not waited for: staged
        t.fill_(3.0)
        fut.result()
        assert not torch.equal(s.get_tables(2)["u"], t)


@pytest.mark.parametrize("after", [False, True])
def test_interrupted_wait_then_a_changed_table_never_commits_mixed_values(tmp_path, after):
    s = cnrstore.open(tmp_path / "s", create=True, block_rows=256, max_inflight=1)
    t = torch.randn(20_000, 8)
    want = t.clone()
    s._core.writer._jobs = _InterruptingJobs(s._core.writer._jobs, after=after)
    with pytest.raises(KeyboardInterrupt):
        s.put_tables(1, {"t": t})
    t.fill_(-7.0)  # the caller changes the table as soon as put returns
    steps = _steps_within(s, 60)
    if steps:
        assert torch.equal(s.get_tables(1)["t"], want)
    assert not after or steps in ([], [1])
    s.put_tables(2, {"t": t})  # the handle stays usable
    assert torch.equal(s.get_tables(2)["t"], t)
    s.close()


CHILD = """
import sys, torch, cnrstore
def table(k):
    return torch.randn(200_000, 32, generator=torch.Generator().manual_seed(k))
s = cnrstore.open(sys.argv[1], block_rows=4096)
k = 0
print("ready", flush=True)
try:
    while True:
        k += 1
        t = table(k)
        s.put_tables(k, {f"t{k}": t})   # a new table every step: always a full put
except KeyboardInterrupt:
    t.fill_(-7.0)
steps = s.steps()
for j in steps:
    assert torch.equal(s.get_tables(j)[f"t{j}"], table(j)), j
print("ok", k, k in steps, flush=True)
"""


@pytest.mark.slow  # a crash test; test_interrupt.py keeps a SIGINT case in the default run
def test_sigint_during_borrowed_puts_then_a_changed_table(tmp_path):
    rng = random.Random(4)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for i in range(3):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / f"s{i}")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.3, 2.0))
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0 and out.startswith("ok"), out + err


@pytest.mark.parametrize("scheme", ["exact", "int8"])
def test_first_put_fingerprints_taken_while_writing_make_the_next_put_incremental(
        tmp_path, scheme):
    t = torch.randn(10_000, 8)
    with cnrstore.open(tmp_path / "s", create=True, block_rows=512) as s:
        s.put_tables(1, {"t": t}, quant=scheme)
        assert s._core.states["t"].fingerprints is not None
        t[17] += 1
        info = s.put_tables(2, {"t": t}, quant=scheme)
        assert info.rows_changed["t"] == 1
        if scheme == "exact":
            assert torch.equal(s.get_tables(2)["t"], t)

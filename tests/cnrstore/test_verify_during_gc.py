"""verify in one process while another puts and gcs: steps dropped meanwhile are not
reported as missing or damaged (issue 8, "errors that lie")."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch

import cnrstore

CHURN = textwrap.dedent(
    """
    import sys, time, torch, cnrstore
    path, seconds = sys.argv[1], float(sys.argv[2])
    g = torch.Generator().manual_seed(1)
    t = torch.randn(256, 8, generator=g)
    deadline = time.monotonic() + seconds
    step = 100
    with cnrstore.open(path, block_rows=32, lock_timeout=30) as s:
        while time.monotonic() < deadline:
            t[step % 256] += 1.0
            s.put_tables(step, {"t": t})
            s.gc(keep_last=2)
            step += 1
    print(step - 100, flush=True)
    """
)


def test_verify_beside_a_gc_reports_no_dropped_step(tmp_path):
    path = tmp_path / "ckpt"
    with cnrstore.open(path, block_rows=32) as s:
        s.put_tables(1, {"t": torch.zeros(256, 8)})
    churn = subprocess.Popen([sys.executable, "-c", CHURN, str(path), "6"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = 0
    try:
        with cnrstore.open(path, block_rows=32) as s:
            time.sleep(0.5)
            while churn.poll() is None:
                report = s.verify(deep=False)
                assert report.ok, report.problems[:3]
                runs += 1
    finally:
        out, err = churn.communicate(timeout=120)
    assert churn.returncode == 0, err[-2000:]
    assert runs > 3 and int(out) > 3, (runs, out)

"""The overhead part of benches/bench_torchrec.py: its options, the runs' rotation, the
per-thread CPU it attributes to a checkpoint, and a tiny end-to-end run at 2 real gloo
ranks (slow: it trains TorchRec's DLRM)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import bench_torchrec as bt  # noqa: E402


def test_steps_one_count_or_one_per_interval():
    a = bt.parse_args(["--out", "x", "--every", "10,100"])
    assert bt._steps(a) == {10: 200, 100: 600}
    a = bt.parse_args(["--out", "x", "--every", "10,100", "--overhead-steps", "300"])
    assert bt._steps(a) == {10: 300, 100: 300}
    a = bt.parse_args(["--out", "x", "--every", "100", "--overhead-steps", "1000"])
    assert bt._steps(a) == {100: 1000}
    with pytest.raises(SystemExit):
        bt._steps(bt.parse_args(["--out", "x", "--every", "10,100",
                                 "--overhead-steps", "1,2,3"]))
    assert bt._steps(bt.parse_args(["--out", "x", "--quick"])) == {10: 20}


def test_order_rotates_every_system_through_every_place():
    systems = ["none", "cnr", "dcp_async"]
    order = bt._order(systems, 3)
    assert len(order) == 9
    rounds = [[s for i, s in order if i == r] for r in range(3)]
    assert all(sorted(r) == sorted(systems) for r in rounds)
    for place in range(3):
        assert sorted(r[place] for r in rounds) == sorted(systems)


def test_a_python_threads_cpu_is_the_checkpoints_not_trainings():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name="cnrstore-writer")
    t.start()
    try:
        time.sleep(0.3)
        assert t.native_id not in bt._training_threads()
        cpu = bt._thread_cpu()
        assert cpu["cnrstore-writer"] > 0.05
        assert threading.main_thread().native_id not in bt._training_threads()
    finally:
        stop.set()
        t.join()


def test_direct_is_the_slowest_stall_per_checkpoint_plus_cpu_at_the_runs_parallelism():
    ranks = [{"stalls": [0.1, 0.3], "ckpt_bg_cpu_s": 0.4, "hook_cpu_s": 0.2},
             {"stalls": [0.2, 0.1], "ckpt_bg_cpu_s": 0.2, "hook_cpu_s": 0.0}]
    # stalls: 0.2 + 0.3; CPU 0.8 s at 2 busy cores: 0.4; over a 9 s run
    assert bt._direct(ranks, 9.0, 2.0) == pytest.approx((0.5 / 9.0, 0.9 / 9.0))


@pytest.mark.slow
def test_overhead_part_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, "benches/bench_torchrec.py", "--quick",
                           "--parts", "overhead", "--overhead-systems", "none,cnr,tracker",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "bench_torchrec.json").read_text())["overhead"]["10"]
    assert r["steps"] == 20 and set(r["direct"]) == set(r["stall_share"]) == {"cnr",
                                                                              "tracker"}
    none, cnr, tracker = (r["ranks"][s][0] for s in ("none", "cnr", "tracker"))
    for x in none:
        assert x["saves"] == 0 and x["hook_cpu_s"] == 0 and x["ckpt_bg_cpu_s"] < 0.02
    for x in cnr:
        # checkpoints at steps 10 (20 steps: the first is the warm-up's)
        assert x["saves"] == len(x["stalls"]) == 1
        assert x["hook_cpu_s"] > 0 and x["ckpt_bg_cpu_s"] > 0
        assert x["thread_cpu"].get("cnrstore-writer", 0) > 0
    assert all(x["hook_cpu_s"] > 0 and x["ckpt_bg_cpu_s"] < 0.02 for x in tracker)
    assert "direct" in (tmp_path / "bench_torchrec.md").read_text()

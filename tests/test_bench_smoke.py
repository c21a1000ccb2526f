"""The checkpoint benchmark (benches/bench_checkpoint.py): its parts and a tiny end-to-end run.

The end-to-end run is the CI smoke test: ``--quick`` in a subprocess, then the JSON's
structure and the sanity of its numbers (bytes are allocated bytes, incremental cnrstore
steps write less than torch.save, restores give back what was put).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import bench_checkpoint, report  # noqa: E402
from benches.bench_checkpoint import parse_args  # noqa: E402
from benches.measure import (  # noqa: E402
    Measured,
    PeakMemory,
    disk_bytes,
    evict_page_cache,
    resident_pages,
)
from benches.workload import (  # noqa: E402
    Workload,
    apply_update,
    changed_rows,
    make_tables,
    table_specs,
)


def _has_store_api() -> bool:
    import cnrstore

    return callable(getattr(cnrstore, "open", None))


# --- workload ---------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 5000),
    fraction=st.sampled_from([0.001, 0.01, 0.05, 0.2, 0.5, 1.0]),
    dist=st.sampled_from(["zipf", "uniform"]),
    step=st.integers(1, 50),
)
def test_changed_rows_exact_count_distinct_in_range(rows, fraction, dist, step):
    w = Workload(fraction, dist)
    ids = changed_rows(rows, w, seed=7, step=step, table_index=1)
    assert len(ids) == max(1, min(rows, round(fraction * rows)))
    assert ids.dtype == np.int64
    assert np.all(np.diff(ids) > 0)  # sorted and distinct
    assert ids[0] >= 0 and ids[-1] < rows
    again = changed_rows(rows, w, seed=7, step=step, table_index=1)
    assert np.array_equal(ids, again)


def test_zipf_rows_are_hot_and_scattered_uniform_rows_are_not_hot():
    rows, steps = 100_000, 4
    sets = {d: [set(changed_rows(rows, Workload(0.05, d), seed=1, step=s, table_index=0))
                for s in range(1, steps + 1)] for d in ("zipf", "uniform")}
    overlap = {d: len(v[0] & v[1]) / len(v[0]) for d, v in sets.items()}
    # Uniform 5% samples overlap by ~5%; Zipf keeps a hot set that changes every interval.
    assert overlap["uniform"] < 0.08
    assert overlap["zipf"] > 3 * overlap["uniform"]
    # Hot rows are scattered over the table, not packed at its start.
    hot = sorted(set.intersection(*sets["zipf"]))
    assert len(hot) > 100
    assert np.median(hot) > rows * 0.3 and np.median(hot) < rows * 0.7


def test_tables_and_updates_are_deterministic_and_change_exactly_the_chosen_rows():
    specs = table_specs(scale=0.001)
    assert len(specs) >= 3 and len({r for r, _ in specs.values()}) == len(specs)
    a, b = make_tables(specs, seed=3), make_tables(specs, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    before = {k: v.clone() for k, v in a.items()}
    w = Workload(0.05, "zipf")
    touched = {}
    n = apply_update(a, w, seed=3, step=1, touched=touched)
    apply_update(b, w, seed=3, step=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    total = 0
    for i, (name, t) in enumerate(a.items()):
        changed = (t != before[name]).any(dim=1).nonzero().flatten().numpy()
        want = changed_rows(t.shape[0], w, seed=3, step=1, table_index=i)
        assert np.array_equal(changed, want), name
        assert np.array_equal(touched[name], want), name
        total += len(want)
    assert n == total


def test_default_scale_is_at_least_one_gib_of_fp32():
    rows = sum(r * d for r, d in table_specs().values())
    assert rows * 4 >= 1 << 30


@pytest.mark.parametrize("bad", [dict(fraction=0.0, dist="zipf"), dict(fraction=1.5, dist="zipf"),
                                 dict(fraction=0.1, dist="pareto")])
def test_bad_workload_is_refused(bad):
    with pytest.raises(ValueError):
        Workload(**bad)


# --- measurement ------------------------------------------------------------------------


def test_disk_bytes_counts_allocated_blocks_not_apparent_size(tmp_path):
    sparse = tmp_path / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(64 << 20)  # 64 MiB apparent, nothing allocated
    dense = tmp_path / "sub" / "dense"
    dense.parent.mkdir()
    dense.write_bytes(os.urandom(1 << 20))
    got = disk_bytes(tmp_path)
    assert 1 << 20 <= got < 2 << 20
    assert disk_bytes(tmp_path / "missing") == 0
    assert evict_page_cache(tmp_path) in ("fadvise", "none")
    assert dense.read_bytes()[:4] == dense.read_bytes()[:4]  # still readable after eviction


def test_measured_splits_main_thread_and_background_cpu_and_counts_reads(tmp_path):
    import threading

    f = tmp_path / "f.bin"
    f.write_bytes(os.urandom(1 << 20))

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    with Measured(str(tmp_path / "prof"), "region", 3) as m:
        t = threading.Thread(target=spin, args=(0.15,))
        t.start()
        t.join()
        spin(0.05)
        f.read_bytes()
    got = m.got
    assert got["bg_cpu_s"] >= 0.12 and got["main_cpu_s"] >= 0.04
    assert got["cpu_s"] == pytest.approx(got["main_cpu_s"] + got["bg_cpu_s"])
    assert got["read_chars"] >= 1 << 20
    assert got["wall_s"] >= 0.19
    assert (tmp_path / "prof" / "region_3.prof").exists()
    assert "spin" in (tmp_path / "prof" / "region_3.txt").read_text()


def _cachestat(path) -> int | None:
    """Pages of ``path`` in the page cache by the cachestat syscall (Linux 6.5+), a witness
    independent of measure.py's mincore that reads nothing; None where it is missing.
    (A RWF_NOWAIT read cannot witness: on a miss the kernel starts a readahead before it
    gives up, and on a fast disk the page can be there by the time it looks, as the
    suite saw.)"""
    import ctypes
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):
        return None  # 451 is cachestat's number in these two tables only
    libc = ctypes.CDLL(None, use_errno=True)
    rng = (ctypes.c_uint64 * 2)(0, 0)  # offset 0, length 0: to the end of the file
    stat = (ctypes.c_uint64 * 5)()  # nr_cache first
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(ctypes.c_long(451), fd, rng, stat, 0) != 0:
            return None  # ENOSYS: an older kernel
        return int(stat[0])
    finally:
        os.close(fd)


def _resident(path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_pages(fd)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_eviction_takes_a_file_or_a_directory(tmp_path):
    # Regression: a file's path was walked as a directory, and nothing was evicted (a
    # torch.load measured "cold" was warm). Regression too (CI): a file read a moment
    # before stayed warm, and the earlier checks' RWF_NOWAIT reads started readahead.
    # Both witnesses read nothing: mincore (measure.py's) and cachestat (the kernel's).
    f = tmp_path / "d" / "f.bin"
    f.parent.mkdir()
    f.write_bytes(os.urandom(1 << 20))
    os.sync()
    f.read_bytes()
    assert _resident(f) == (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    evict_page_cache(f.parent)
    if _resident(f):
        pytest.skip("this filesystem keeps the pages (no POSIX_FADV_DONTNEED)")
    for _ in range(20):
        f.read_bytes()
        assert _resident(f) > 0
        evict_page_cache(f)
        assert _resident(f) == 0
        assert _cachestat(f) in (0, None)


def test_resident_pages_counts_what_was_read(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"")
    assert _resident(f) == 0  # an empty file has no pages, and maps nothing
    f.write_bytes(os.urandom(64 << 10))
    os.sync()
    evict_page_cache(f)
    if _resident(f):
        pytest.skip("this filesystem keeps the pages (no POSIX_FADV_DONTNEED)")
    with open(f, "rb") as fh:
        fh.read(4096)  # one page read (plus what readahead brings), never the file's end
    assert 1 <= _resident(f) <= (64 << 10) // os.sysconf("SC_PAGE_SIZE")


def test_peak_memory_sees_a_transient_allocation():
    mem = PeakMemory()
    mem.start()
    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched
    del block
    peak = mem.stop()
    if mem.method == "clear_refs":
        assert peak["peak_over_start"] >= 60 << 20
    assert peak["peak_rss"] >= 64 << 20


# --- report -----------------------------------------------------------------------------


def test_median_merge_takes_medians_and_all_of_flags():
    runs = [{"a": 1, "b": [3.0, 9.0], "ok": True, "s": "x"},
            {"a": 5, "b": [1.0, 7.0], "ok": True, "s": "x"},
            {"a": 2, "b": [2.0, 8.0], "ok": False, "s": "x"}]
    assert report.median_merge(runs) == {"a": 2, "b": [2.0, 8.0], "ok": False, "s": "x"}


def test_check_targets_compares_against_limits():
    summary = {report.TARGET_WORKLOAD: {
        "cnr_int8": {"write_reduction": 25.0, "incr_put_ratio": 0.7, "restore_ratio": 1.0},
        "cnr_exact": {"write_reduction": 5.0, "incr_put_ratio": 0.2, "restore_ratio": 2.0},
    }}
    met = {(c["system"], c["target"].split()[0]): c["met"]
           for c in report.check_targets(summary)}
    assert met[("cnr_int8", "write_reduction")] is True
    assert met[("cnr_exact", "write_reduction")] is False
    assert met[("cnr_int8", "incr_put_ratio")] is False
    assert met[("cnr_exact", "incr_put_ratio")] is True
    assert met[("cnr_exact", "restore_ratio")] is False


@pytest.mark.parametrize("argv", [["--scale", "0"], ["--steps", "0"], ["--repeat", "0"],
                                  ["--systems", "torch_save,nope"], ["--fractions", "0"],
                                  ["--threads", "-1"],
                                  ["--dists", "pareto"]])
def test_bad_arguments_are_refused_before_running(argv, tmp_path):
    with pytest.raises(SystemExit):
        parse_args(argv + ["--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


# --- end to end -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    systems = ["torch_save", "dcp"]
    if _has_store_api():
        # blocking int8 would add time, not coverage
        systems += ["cnr_exact", "cnr_exact_touched", "cnr_int8_async"]
    cmd = [sys.executable, str(REPO / "benches" / "bench_checkpoint.py"), "--quick",
           "--systems", ",".join(systems), "--fractions", "0.01", "--dists", "zipf",
           "--out", str(out), "--plot", str(out / "restore.png")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), out, systems


def test_quick_run_writes_json_and_markdown_of_every_system(quick_run):
    doc, out, systems = quick_run
    assert set(doc) == {"meta", "summary", "targets", "runs", "failures"}
    assert doc["failures"] == []
    assert list(doc["summary"]) == ["zipf-1pct"]
    assert set(doc["summary"]["zipf-1pct"]) == set(systems)
    assert doc["meta"]["steps"] == 2 and doc["meta"]["repeat"] == 1
    assert doc["meta"]["n_tables"] == len(doc["meta"]["tables"]) == len(table_specs())
    md = (out / "results.md").read_text()
    assert all(f"| {s} |" in md for s in systems)
    # --plot: restore time per system, drawn by the run and again from its JSON alone
    assert (out / "restore.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = out / "again.png"
    assert bench_checkpoint.main(["--plot", str(again), str(out / "results.json")]) == 0
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_run_numbers_are_sane(quick_run):
    doc, _, _ = quick_run
    rows = doc["summary"]["zipf-1pct"]
    logical = rows["torch_save"]["logical_bytes"]
    for system, job in doc["runs"].items():
        res = job[0]["workloads"]["zipf-1pct"]
        cum = [s["cum_bytes"] for s in res["steps"]]
        assert len(cum) == 3 and cum == sorted(cum), system
        assert all(s["put_s"] > 0 and s["stall_s"] <= s["put_s"] + 1e-9 for s in res["steps"])
        assert res["restore_latest_s"] > 0 and res["restore_oldest_s"] > 0
        assert res["latest_error"]["same_layout"] is True
        # Warm is the median of three restores, the first kept beside it (worker.py).
        warm = res["restore_warm_samples_s"]
        assert len(warm) == 3 and all(w > 0 for w in warm), system
        assert res["restore_warm_s"] == sorted(warm)[1], system
        assert res["restore_warm_first_s"] == warm[0], system
    assert rows["cnr_exact"]["warm_first_ratio"] == pytest.approx(
        rows["cnr_exact"]["restore_warm_first_s"] / rows["torch_save"]["restore_warm_first_s"])
    for system in ("torch_save", "dcp"):  # full copies each step, bit-exact
        row = rows[system]
        assert logical <= row["incr_bytes"] < 1.5 * logical + (1 << 20)
        assert row["bit_exact_latest"] and row["oldest_bit_exact"]
    assert rows["torch_save"]["write_reduction"] == pytest.approx(1.0)


@pytest.mark.skipif(not _has_store_api(), reason="cnrstore.open has not landed yet")
def test_quick_run_cnrstore_writes_less_and_restores_what_was_put(quick_run):
    doc, _, _ = quick_run
    rows = doc["summary"]["zipf-1pct"]
    ts = rows["torch_save"]
    for system in ("cnr_exact", "cnr_int8_async"):
        row = rows[system]
        assert 0 < row["incr_bytes"] < ts["incr_bytes"], system
        assert row["cum_bytes"] < ts["cum_bytes"], system
    for system in ("cnr_exact", "cnr_exact_touched"):
        assert rows[system]["bit_exact_latest"] and rows[system]["oldest_bit_exact"], system
    # Touched ids name exactly the changed rows: the same rows get written.
    assert rows["cnr_exact_touched"]["incr_bytes"] == pytest.approx(
        rows["cnr_exact"]["incr_bytes"], rel=0.1)
    int8 = rows["cnr_int8_async"]
    assert not int8["bit_exact_latest"] and 0 < int8["rel_rmse"] < 0.02
    assert int8["incr_bytes"] < rows["cnr_exact"]["incr_bytes"]
    assert int8["incr_stall_s"] <= int8["incr_put_s"]


def test_plot_writes_pngs_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    summary = {"zipf-5pct": {"torch_save": {"incr_bytes": 1e8, "incr_put_s": 1.0},
                             "cnr_int8": {"incr_bytes": 1e6, "incr_put_s": 0.3}}}
    written = report.plot(summary, tmp_path)
    assert written == ["incr_bytes.png", "incr_put_s.png"]
    assert all((tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in written)


# --- stage profiler ---------------------------------------------------------------------


def test_stage_timers_count_exclusive_time_per_thread():
    import threading
    import time as _time

    from benches.profile_put import StageTimers

    timers = StageTimers()

    def inner():
        _time.sleep(0.05)

    inner_t = timers._wrap(inner, "inner")

    def outer():
        _time.sleep(0.02)
        inner_t()

    outer_t = timers._wrap(outer, "outer")
    threads = [threading.Thread(target=outer_t) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds, calls = timers.take()
    assert calls == {"inner": 2, "outer": 2}
    assert 0.1 <= seconds["inner"] < 0.2
    assert 0.04 <= seconds["outer"] < 0.09  # the nested sleep is not counted twice
    assert timers.take() == ({}, {})


def test_stage_timers_find_every_stage_and_undo_their_patches():
    import cnrstore.core.snapshot
    from benches.profile_put import StageTimers

    before = cnrstore.core.snapshot.row_fingerprints
    timers = StageTimers()
    timers.install()
    try:
        assert timers.missing == [], "renamed functions are no longer timed"
        assert cnrstore.core.snapshot.row_fingerprints is not before
    finally:
        timers.remove()
    assert cnrstore.core.snapshot.row_fingerprints is before


# --- quantization bench (benches/bench_quant.py) --------------------------------------------


def test_bench_quant_quick_run_reports_every_scheme_before_and_after(tmp_path):
    out = tmp_path / "quant"
    cmd = [sys.executable, str(REPO / "benches" / "bench_quant.py"), "--quick",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "bench_quant.json").read_text())
    assert (out / "bench_quant.md").read_text().count("| int") == 8
    assert doc["torch_save"]["incr_put_s"] > 0
    res = doc["results"]
    assert set(res) == {f"{i}/{s}" for i in ("grid", "greedy")
                        for s in ("int8", "int4", "int3", "int2")}
    for r in res.values():
        assert r["encode_mb_s"] > 0 and r["incr_put_s"] > 0 and r["full_put_s"] > 0
        assert r["incr_put_vs_int8"] > 0 and r["incr_put_vs_torch_save"] > 0
    # int8 searches min/max either way; below it the grid search is no worse than the walk.
    assert res["grid/int8"]["rel_l2_error"] == res["greedy/int8"]["rel_l2_error"]
    for s in ("int4", "int3", "int2"):
        assert res[f"grid/{s}"]["rel_l2_error"] <= res[f"greedy/{s}"]["rel_l2_error"] * 1.001
    errs = [res[f"grid/{s}"]["rel_l2_error"] for s in ("int8", "int4", "int3", "int2")]
    assert errs == sorted(errs) and 0 < errs[0]  # fewer bits, more error
    assert [p.name for p in out.iterdir() if p.name.startswith("cnrquant-")] == []


def test_torch_save_is_timed_both_ways_and_the_faster_is_the_peer(quick_run):
    """Issue 27: a file kept per step and one file replaced per step, at every step; the
    peer of every put time is the faster of the two, and the report names both."""
    doc, out, _ = quick_run
    steps = doc["runs"]["torch_save"][0]["workloads"]["zipf-1pct"]["steps"]
    for rec in steps:
        assert rec["put_keep_s"] > 0 and rec["put_replace_s"] > 0
        assert rec["put_s"] == min(rec["put_keep_s"], rec["put_replace_s"])
        assert rec["peer_way"] in ("keep", "replace")
    row = doc["summary"]["zipf-1pct"]["torch_save"]
    assert row["incr_put_s"] <= max(row["incr_put_keep_s"], row["incr_put_replace_s"])
    assert "replaced per step" in (out / "results.md").read_text()


@pytest.mark.slow
def test_bench_put_quick_run_reports_ratios_against_the_peer(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benches" / "bench_put.py"), "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_put.json").read_text())
    rep = doc["repeats"][0]
    assert set(rep["ratios"]) == {"cnr_int8_async", "cnr_int8", "cnr_exact"}
    for r in rep["ratios"].values():
        assert all(v > 0 for v in r.values())
    assert rep["fresh_full_put"]["ratio"] > 0
    assert rep["puts"]["fingerprint"]["fp_one_core_gbs"] > 0
    assert "replaced per step" in (tmp_path / "bench_put.md").read_text()


def test_torchrec_restore_alone_needs_the_saved_run(capsys):
    # Regression: `--parts restore` with no saved run printed an empty table and exit 0.
    from benches import bench_torchrec

    with pytest.raises(SystemExit):
        bench_torchrec.parse_args(["--parts", "restore", "--out", "x"])
    assert "--root" in capsys.readouterr().err
    assert bench_torchrec.parse_args(["--parts", "restore", "--root", "r", "--out", "x"]).root

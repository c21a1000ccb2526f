"""Crash safety: a writer process SIGKILLed at each named point of the commit and gc
protocols (engine/fs/crashpoints.py) and at random moments, then the store reopened.

After every crash: verify(deep=True) is clean, every committed root reads back byte for
byte, nothing uncommitted is visible, and a gc in the survivor gives back the bytes the
dead writer left behind (allocated pack bytes drop to what the live roots need).
"""

from __future__ import annotations

import pathlib
import random
import shutil
import signal
import time

import pytest
from _helpers import (
    check_dag,
    committed,
    dag_absent,
    open_store,
    pack_bytes,
    pack_files,
    put_dag,
    run,
    spawn,
)

import engine
from engine.fs.crashpoints import POINTS

SMALL = 4096
BIG = 256 * 1024  # the crashed commit's leaves: big enough that leftovers show on disk
SLACK = 64 * 1024  # pack trailers, headers and block rounding


def _seed_store(path, n: int = 3) -> int:
    """Roots r0..r{n-1}, committed and closed; returns allocated pack bytes."""
    with open_store(path) as store:
        for i in range(n):
            with store.writer() as w:
                put_dag(w, i, size=SMALL)
    return pack_bytes(path)


def _check_survivor(path, kept: list[int], gone: list[int], *, sizes: dict[int, int]) -> None:
    with open_store(path) as store:
        report = store.verify(deep=True)
        assert report.ok, report.problems
        for i in kept:
            check_dag(store, i, size=sizes.get(i, SMALL))
        for i in gone:
            assert dag_absent(store, i, size=sizes.get(i, SMALL)), f"r{i} half visible"
        assert set(store.roots()) == {f"r{i}" for i in kept}


WRITER_POINTS = [p for p in POINTS if p.startswith("writer.")]
GC_POINTS = [p for p in POINTS if p.startswith("gc.")]


def test_every_crash_point_is_covered_and_reached():
    # A point added to crashpoints.POINTS without a kill test here would go untested, and
    # one the engine no longer calls is a protocol step nobody checks any more.
    assert set(POINTS) == set(WRITER_POINTS) | set(GC_POINTS)
    engine_dir = pathlib.Path(engine.__file__).parent
    sources = "".join(p.read_text() for p in engine_dir.rglob("*.py"))
    for point in POINTS:
        assert f'crashpoints.hit("{point}")' in sources, f"{point} is never hit"


@pytest.mark.parametrize("point", WRITER_POINTS)
def test_writer_killed_at_commit_point(tmp_path, point):
    path = tmp_path / "store"
    baseline = _seed_store(path)
    rc, lines, err = run("write", path, 3, 2, BIG, env={"CNRSTORE_CRASH_AT": point})
    assert rc == -signal.SIGKILL, f"worker did not reach {point}: rc={rc} {err}"
    assert committed(lines) == []
    sizes = {3: BIG, 4: BIG}
    if point in ("writer.after_index_commit", "writer.after_pack_fsync"):
        # The commit is durable: it only died before telling anyone. After the pack
        # fsync its sealed roots record is newer than the index, and an index behind its
        # packs is never trusted: the next open brings it up to date (FORMAT.md "Index
        # freshness"), whole.
        _check_survivor(path, [0, 1, 2, 3], [4], sizes=sizes)
    else:
        _check_survivor(path, [0, 1, 2], [3, 4], sizes=sizes)
        assert pack_bytes(path) > baseline, "the dead writer left no bytes: nothing to test"
        with open_store(path) as store:
            store.gc(threshold=0.0)
            check_dag(store, 2)
        assert pack_bytes(path) <= baseline + SLACK, "gc did not reclaim the orphans"
        _check_survivor(path, [0, 1, 2], [3, 4], sizes=sizes)
    # The store takes new commits after the crash.
    rc, lines, err = run("write", path, 5, 1, SMALL)
    assert rc == 0, err
    assert committed(lines) == [5]


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.999, 1.0])
def test_torn_leftover_pack_and_lost_index(tmp_path, cut):
    """A power cut mid-commit may leave the new packs torn anywhere, and the index may be
    lost with them: repair from the packs alone must bring back every committed root and
    never a partial DAG (the dead commit's root may come back only if it is complete)."""
    path = tmp_path / "store"
    _seed_store(path)
    before = set(pack_files(path))
    rc, _, err = run("write", path, 3, 1, BIG, env={"CNRSTORE_CRASH_AT": "writer.after_pack_write"})
    assert rc == -signal.SIGKILL, err
    leftovers = [p for p in pack_files(path) if p not in before]
    assert leftovers, "the dead writer left no pack"
    for p in leftovers:
        size = p.stat().st_size
        with open(p, "r+b") as f:
            f.truncate(int(size * cut))
    shutil.rmtree(path / "index")
    with open_store(path) as store:  # rebuilt from the packs on open
        for i in (0, 1, 2):
            check_dag(store, i)
        assert set(store.roots()) <= {"r0", "r1", "r2", "r3"}
        complete = store.root("r3") is not None
        if complete:
            check_dag(store, 3, size=BIG)
        # Intact records of the dead commit may be indexed again (unreachable, and safe to
        # dedup against: each one passed its checksum and id); gc collects them.
        assert store.verify(deep=True).ok
        store.gc(threshold=0.0)
        assert store.verify(deep=True).ok
        if not complete:
            assert dag_absent(store, 3, size=BIG)


@pytest.mark.parametrize("point", ["writer.after_pack_write", "writer.after_pack_fsync"])
def test_commits_right_after_a_crash_do_not_trip_on_leftovers(tmp_path, point):
    # The dead writer's pack files are on disk but unindexed; the next writers must not
    # reuse or append to them, and a later repair must not mistake them for commits.
    path = tmp_path / "store"
    baseline = _seed_store(path)
    rc, _, err = run("write", path, 3, 1, BIG, env={"CNRSTORE_CRASH_AT": point})
    assert rc == -signal.SIGKILL, err
    existing = {p: p.read_bytes() for p in pack_files(path)}
    rc, lines, err = run("write", path, 4, 3, SMALL)
    assert rc == 0, err
    assert committed(lines) == [4, 5, 6]
    for p, data in existing.items():  # nothing was appended to or rewrote a pack
        assert p.read_bytes() == data
    # A sealed commit is brought back whole by the next writer; an unsealed one never.
    back = [3] if point == "writer.after_pack_fsync" else []
    kept = sorted([0, 1, 2, 4, 5, 6] + back)
    _check_survivor(path, kept, [] if back else [3], sizes={3: BIG})
    with open_store(path) as store:
        # The dead commit's roots record is on disk too; repair must still pick the
        # newest committed one.
        rep = store.repair()
        assert rep.roots_restored == len(kept)
        assert set(store.roots()) == {f"r{i}" for i in kept}
        store.gc(threshold=0.0)
        assert dag_absent(store, 3, size=BIG) == (not back)
        for i in kept:
            check_dag(store, i, size=BIG if i == 3 else SMALL)
    assert pack_bytes(path) <= baseline * 2 + SLACK + (3 * BIG * 2 if back else 0)


def test_writer_killed_on_second_commit(tmp_path):
    path = tmp_path / "store"
    _seed_store(path)
    env = {"CNRSTORE_CRASH_AT": "writer.after_pack_fsync:2"}
    rc, lines, err = run("write", path, 3, 3, SMALL, env=env)
    assert rc == -signal.SIGKILL, err
    assert committed(lines) == [3]
    # Commit 4 died after sealing its packs: the next open brings it back whole.
    _check_survivor(path, [0, 1, 2, 3, 4], [5], sizes={})


def _seed_garbage(path) -> tuple[int, int]:
    """Roots r0..r3 with r1, r2 (big) then dropped; returns (pack bytes, bytes dropped)."""
    with open_store(path) as store:
        for i in range(4):
            with store.writer() as w:
                put_dag(w, i, size=BIG if i in (1, 2) else SMALL)
        with store.writer() as w:
            w.delete_root("r1")
            w.delete_root("r2")
    return pack_bytes(path), 2 * 3 * BIG


@pytest.mark.parametrize("point", GC_POINTS)
def test_gc_killed_at_point(tmp_path, point):
    path = tmp_path / "store"
    before, dropped = _seed_garbage(path)
    rc, lines, err = run("gc", path, 0.0, env={"CNRSTORE_CRASH_AT": point})
    assert rc == -signal.SIGKILL, f"gc did not reach {point}: rc={rc} {err}"
    sizes = {1: BIG, 2: BIG}
    _check_survivor(path, [0, 3], [1, 2] if point != "gc.after_mark" else [], sizes=sizes)
    with open_store(path) as store:
        store.gc(threshold=0.0)
    _check_survivor(path, [0, 3], [1, 2], sizes=sizes)
    after = pack_bytes(path)
    assert after <= before - dropped + SLACK, f"gc after a crash reclaimed too little: {after}"


def test_gc_after_mark_leaves_garbage_readable_until_gc(tmp_path):
    # A gc that died after marking changed nothing: the dropped DAGs are still stored
    # (unreachable but intact), and a later gc frees exactly them.
    path = tmp_path / "store"
    _seed_garbage(path)
    rc, _, err = run("gc", path, 0.0, env={"CNRSTORE_CRASH_AT": "gc.after_mark"})
    assert rc == -signal.SIGKILL, err
    with open_store(path) as store:
        # 4 DAGs of 4 own objects, plus one shared leaf per leaf size (small, big).
        assert store.stats().objects == 4 * 4 + 2
        report = store.gc(threshold=0.0)
        assert report.objects_freed == 2 * 4 + 1  # r1, r2's own objects and their shared leaf
        assert store.stats().objects == 2 * 4 + 1
        check_dag(store, 0)
        check_dag(store, 3)


@pytest.mark.parametrize(
    "seed", [*range(3), *(pytest.param(s, marks=pytest.mark.slow) for s in range(3, 40))]
)
def test_writer_killed_at_random_moment(tmp_path, seed):
    """A churning writer (commits, root drops, gc) killed at a random time."""
    path = tmp_path / "store"
    _seed_store(path, n=1)
    proc = spawn("churn", path, 1, 32 * 1024, 30)
    first = proc.stdout.readline()  # the kill lands mid-churn, not during start-up
    time.sleep(random.Random(seed).random() * 0.8)
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err
    done = committed([first, *out.splitlines()])
    assert done, err
    size = 32 * 1024
    with open_store(path) as store:
        report = store.verify(deep=True)
        assert report.ok, report.problems
        check_dag(store, 0)
        # The last printed commit is live (only the commit after next drops it); the one
        # in flight when the kill came may or may not have landed, but never half.
        if done:
            check_dag(store, done[-1], size=size)
        inflight = done[-1] + 1 if done else 1
        if store.root(f"r{inflight}") is not None:
            check_dag(store, inflight, size=size)
        else:
            assert dag_absent(store, inflight, size=size)
        allowed = {"r0"} | {f"r{i}" for i in range(inflight - 2, inflight + 1)}
        assert set(store.roots()) <= allowed
        store.gc(threshold=0.0)
        live = len(store.roots())
        assert store.verify(deep=True).ok
    # What stays on disk is what the live roots need, whatever the kill left behind.
    assert pack_bytes(path) <= live * 4 * size + 2 * SLACK


@pytest.mark.parametrize(
    "seed", [*range(3), *(pytest.param(s, marks=pytest.mark.slow) for s in range(3, 30))]
)
def test_repair_killed_at_random_moment(tmp_path, seed):
    """Repair writes a new index beside the old one and swaps them by two renames: a
    kill anywhere in it leaves a store that opens with every root intact."""
    path = tmp_path / "store"
    n = 12
    with open_store(path) as store:
        for i in range(n):
            with store.writer() as w:
                put_dag(w, i, size=2000, leaves=20)
    proc = spawn("repair", path, 30)
    assert proc.stdout.readline().strip() == "open"
    time.sleep(random.Random(seed).random() * 0.6)
    proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, err
    with open_store(path) as store:
        assert set(store.roots()) == {f"r{i}" for i in range(n)}
        for i in range(n):
            check_dag(store, i, size=2000, leaves=20)
        assert store.verify(deep=True).ok
        with store.writer() as w:  # and it takes commits again
            put_dag(w, n, size=2000, leaves=20)
    assert not (path / "index.new").exists() and not (path / "index.old").exists()

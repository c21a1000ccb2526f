"""The distributed commit with real processes (docs/FORMAT.md "Distributed commit"): a
coordinator process reserves packs, three rank processes write them with PackSinks, the
coordinator adopts and commits. Ranks and the coordinator are SIGKILLed at each named
point: no step appears, the next open is not stale, gc reclaims the rank packs, verify is
clean, and a commit killed after its own fsync comes back whole. Every child has a timeout.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import msgpack
import pytest
from _helpers import pack_bytes, pack_files

import engine

WORKER = pathlib.Path(__file__).resolve().parent / "_dist_worker.py"
TIMEOUT = 120


def run_worker(*args: str, crash: str | None = None) -> tuple[int, list[str], str]:
    env = dict(os.environ)
    env.pop("CNRSTORE_CRASH_AT", None)
    if crash:
        env["CNRSTORE_CRASH_AT"] = crash
    proc = subprocess.run([sys.executable, str(WORKER), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def coord(path, step: int, *, rank_crash: str = "-", crash: str | None = None,
          gc_during: bool = False):
    return run_worker("coord", path, 3, step, 3, rank_crash, "yes" if gc_during else "no",
                      crash=crash)


def reserved(lines: list[str]) -> range:
    line = next(ln for ln in lines if ln.startswith("reserved "))
    _, a, b = line.split()
    return range(int(a), int(b))


def rank_pack_files(path, packs: range) -> list[pathlib.Path]:
    return [p for p in pack_files(path) if int(p.stem) in packs]


def check_clean(path, steps: list[int], *, absent: list[int] = ()) -> None:
    with engine.open(path) as store:
        assert store.opened_with_repair is None, "orphan rank packs made the index stale"
        assert set(store.roots()) == {f"r{s}" for s in steps}
        for s in absent:
            assert store.root(f"r{s}") is None
        report = store.verify(deep=True)
        assert report.ok, report.problems


# One crash point of each kind runs in the default suite; its twin (the same kind at
# the next point) runs with the crash suite under -m slow.
SLOW = pytest.mark.slow


@pytest.fixture
def seeded(tmp_path):
    path = tmp_path / "store"
    rc, lines, err = coord(path, 1)
    assert rc == 0 and any(ln.startswith("committed 1 ") for ln in lines), err
    return path


def test_three_rank_processes_and_a_coordinator_commit_one_step(seeded):
    rc, lines, err = coord(seeded, 2)
    assert rc == 0, err
    done = next(ln for ln in lines if ln.startswith("committed 2 "))
    assert "reused=3" in done  # the leaf every rank shares is stored once
    check_clean(seeded, [1, 2])
    with engine.open(seeded) as store:
        top = store.root("r2")
        closure = store.locate_closure([top])
        # the step node, per rank 2 own leaves and a node, and the leaf all ranks share
        assert len(closure) == 1 + 3 * 3 + 1
        for oid in closure:
            store.get(oid)
        before = (store.roots(), store.stats())
        store.repair()
        assert (store.roots(), store.stats()) == before
        assert store.verify(deep=True).ok


def test_a_gc_in_another_process_spares_a_put_in_flight(seeded):
    rc, lines, err = coord(seeded, 2, gc_during=True)
    assert rc == 0, err
    assert any(ln.startswith("other-gc rc=0 gc ") for ln in lines), lines
    assert any(ln.startswith("committed 2 ") for ln in lines), (lines, err)
    check_clean(seeded, [1, 2])


@pytest.mark.parametrize("point", ["sink.after_pack_write",
                                   pytest.param("sink.after_seal", marks=SLOW)])
def test_a_rank_killed_before_reporting_fails_the_step_and_gc_reclaims(seeded, point):
    baseline = pack_bytes(seeded)
    rc, lines, err = coord(seeded, 2, rank_crash=f"1:{point}")
    assert rc == 0, err
    assert any(ln.startswith("failed [(1, -9)]") for ln in lines), lines
    orphans = rank_pack_files(seeded, reserved(lines))
    assert orphans, "the ranks left no packs: nothing to test"
    check_clean(seeded, [1], absent=[2])
    with engine.open(seeded) as store:
        rep = store.gc(threshold=0.0)
        assert rep.bytes_freed > 0
    assert not any(p.exists() for p in orphans)
    assert pack_bytes(seeded) <= baseline
    check_clean(seeded, [1], absent=[2])
    rc, lines, err = coord(seeded, 3)  # the store takes the next step
    assert rc == 0 and any(ln.startswith("committed 3 ") for ln in lines), err
    check_clean(seeded, [1, 3])


@pytest.mark.parametrize("point", ["adopt.after_check",
                                   pytest.param("writer.after_pack_write", marks=SLOW)])
def test_the_coordinator_killed_before_its_fsync_leaves_orphans_for_gc(seeded, point):
    rc, lines, err = coord(seeded, 2, crash=point)
    assert rc == -signal.SIGKILL, f"coordinator did not reach {point}: {rc} {err}"
    assert any(ln.startswith("gathered ") for ln in lines)  # killed past the gather
    orphans = rank_pack_files(seeded, reserved(lines))
    assert orphans
    check_clean(seeded, [1], absent=[2])  # its lease died with it
    with engine.open(seeded) as store:
        assert store.gc(threshold=0.0).bytes_freed > 0
    assert not any(p.exists() for p in orphans)
    check_clean(seeded, [1], absent=[2])


@pytest.mark.parametrize("point", [pytest.param("writer.after_pack_fsync", marks=SLOW),
                                   "writer.after_index_commit"])
def test_the_coordinator_killed_after_its_fsync_comes_back_whole(seeded, point):
    rc, lines, err = coord(seeded, 2, crash=point)
    assert rc == -signal.SIGKILL, err
    with engine.open(seeded) as store:
        # The roots record is newer than the index: rebuilt from the packs, with the
        # adopted rank packs (sealed and fsync'ed before the coordinator's own).
        if point == "writer.after_pack_fsync":
            assert store.opened_with_repair is not None
        assert set(store.roots()) == {"r1", "r2"}
        assert store.verify(deep=True).ok
        assert len(store.locate_closure([store.root("r2")])) == 11
        store.gc(threshold=0.0)
        assert store.verify(deep=True).ok
    check_clean(seeded, [1, 2])


def test_get_tables_through_located_objects_in_another_process(tmp_path):
    torch = pytest.importorskip("torch")
    import cnrstore

    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(0)
    tables = {"user": torch.randn(300, 8, generator=g),
              "item": torch.randint(0, 9, (50, 3), generator=g)}
    with cnrstore.open(path) as cs:
        cs.put_tables(5, tables, quant={"user": "int8"})
        want = cs.get_tables(5)
        store = cs.objects
        roots = store.roots()
        closure = store.locate_closure(roots.values())
    (tmp_path / "locs").write_bytes(engine.encode_locations(closure.values()))
    (tmp_path / "roots").write_bytes(msgpack.packb(roots, use_bin_type=True))
    rc, lines, err = run_worker("read_tables", path, tmp_path / "locs", tmp_path / "roots",
                                tmp_path / "out.pt", 5)
    assert rc == 0, err
    assert "lmdb-envs 0" in lines
    got = torch.load(tmp_path / "out.pt")
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert torch.equal(got[name], want[name])


def test_every_distributed_crash_point_is_killed_here_and_reached():
    from engine.fs.crashpoints import DIST_POINTS

    engine_dir = pathlib.Path(engine.__file__).parent
    sources = "".join(p.read_text() for p in engine_dir.rglob("*.py"))
    tests = pathlib.Path(__file__).read_text()
    for point in DIST_POINTS:
        assert f'crashpoints.hit("{point}")' in sources, f"{point} is never hit"
        assert f'"{point}"' in tests.replace(f'"1:{point}"', f'"{point}"'), point

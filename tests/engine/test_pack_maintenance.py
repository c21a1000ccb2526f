"""The pack store's maintenance: gc (mark, sweep, compact, delete), verify, repair and
the recovery of interrupted swaps (docs/FORMAT.md "Garbage collection", "Verify",
"Recovery and repair")."""

from __future__ import annotations

import os
import pathlib
import random
import shutil

import pytest

import engine
from engine.errors import CorruptObject
from engine.packs.pack import list_pack_files, pack_name


def put_chain(w, n: int, size: int, *, seed: int = 0) -> list[bytes]:
    """n random leaves plus a meta node over them; returns [leaves..., node]."""
    rnd = random.Random(seed)
    leaves = [w.put(1, rnd.randbytes(size)) for _ in range(n)]
    return leaves + [w.put(2, b"node%d" % seed, leaves, meta=True)]


def test_gc_frees_bytes_and_compacts(tmp_path):
    with engine.open(tmp_path / "s", pack_target_size=1 << 20) as store:
        with store.writer() as w:
            keep = put_chain(w, 4, 20_000, seed=1)
            drop = put_chain(w, 16, 20_000, seed=2)
            w.set_root("keep", keep[-1])
            w.set_root("drop", drop[-1])
        with store.writer() as w:
            w.delete_root("drop")
        before = store.stats().stored_bytes
        report = store.gc()
        assert report.objects_freed == 17 and report.objects_live == 5
        assert report.packs_rewritten >= 1 and report.bytes_freed >= 16 * 20_000
        assert store.stats().stored_bytes <= before - report.bytes_freed + 8192
        for oid in keep:
            store.get(oid)
        assert not any(store.has(oid) for oid in drop)
        assert store.verify(deep=True).ok
        again = store.gc()  # idempotent: nothing left to do
        assert (again.objects_freed, again.packs_rewritten, again.packs_deleted) == (0, 0, 0)

def test_gc_deletes_unindexed_leftover_packs(pack_store):
    with pack_store.writer() as w:
        w.set_root("r", w.put(1, b"x" * 100))
    files = list_pack_files(pack_store.path)
    stray = pathlib.Path(str(next(iter(files.values()))).replace("00000000", "00000099"))
    shutil.copyfile(next(iter(files.values())), stray)
    report = pack_store.gc()
    assert not stray.exists() and report.packs_deleted == 1
    assert pack_store.roots().keys() == {"r"}

def test_reader_with_a_stale_location_retries_after_gc(tmp_path):
    path = tmp_path / "s"
    with engine.open(path, pack_target_size=1 << 20) as a, engine.open(path) as b:
        with a.writer() as w:
            keep = w.put(1, os.urandom(1000))
            junk = w.put(1, os.urandom(50_000))
            w.set_root("k", keep)
            w.set_root("j", junk)
        stale = b._lookup(keep)
        with a.writer() as w:
            w.delete_root("j")
        a.gc()
        assert b._core.read_entry(keep, stale) is None  # its pack is gone
        assert b.get(keep) == a.get(keep)

def test_verify_and_get_report_a_flipped_byte(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            ids = put_chain(w, 3, 2000)
            w.set_root("r", ids[-1])
        victim = store._lookup(ids[1])
        pack = list_pack_files(path)[victim.pack]
        with open(pack, "r+b") as f:
            f.seek(victim.offset + victim.length // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert store.verify().ok  # structure is intact
        report = store.verify(deep=True)
        assert not report.ok and [p.what for p in report.problems] == ["corrupt"]
        problem = report.problems[0]
        assert problem.oid == ids[1] and problem.offset == victim.offset
        with pytest.raises(CorruptObject) as info:
            store.get(ids[1])
        assert info.value.offset == victim.offset and info.value.pack.endswith(".pack")

def test_verify_reports_missing_pack_and_roots(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            ids = put_chain(w, 2, 100)
            w.set_root("r", ids[-1])
        data_pack = store._lookup(ids[0]).pack
        list_pack_files(path)[data_pack].unlink()
        report = store.verify(roots=["r", "nope"])
        kinds = sorted(p.what for p in report.problems)
        assert kinds == ["missing-pack", "missing-pack", "missing-root"]

def test_repair_rebuilds_from_packs_after_losing_the_index(tmp_path):
    path = tmp_path / "s"
    with engine.open(path, pack_target_size=4096) as store:
        with store.writer() as w:
            first = put_chain(w, 5, 1500, seed=1)
            w.set_root("a", first[-1])
        with store.writer() as w:
            second = put_chain(w, 2, 1500, seed=2)
            w.set_root("b", second[-1])
            w.delete_root("a")
        expect = store.stats()
    shutil.rmtree(path / "index")
    with engine.open(path) as store:  # index lost: rebuilt from the packs on open
        assert store.roots() == {"b": second[-1]}
        got = store.stats()
        assert (got.objects, got.logical_bytes) == (expect.objects, expect.logical_bytes)
        assert store.verify(deep=True).ok
        report = store.repair()
        assert (report.objects_indexed, report.roots_restored, report.damaged) == (
            expect.objects, 1, ())
        assert store.gc().objects_freed == 6  # what only root "a" reached
        with store.writer() as w:
            w.set_root("c", w.put(1, b"after repair"))
    with engine.open(path) as store:
        assert set(store.roots()) == {"b", "c"}

def test_repair_skips_damaged_records_and_trailers(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            ids = [w.put(1, os.urandom(500)) for _ in range(4)]
            w.set_root("r", w.put(2, b"n", ids, meta=True))
        victim = store._lookup(ids[1])
        pack = list_pack_files(path)[victim.pack]
        raw = bytearray(pack.read_bytes())
        raw[victim.offset + 60] ^= 0xFF  # inside the record
        raw[-3] ^= 0xFF  # inside the trailer checksum
        pack.write_bytes(bytes(raw))
        report = store.repair()
        assert {p.what for p in report.damaged} >= {"corrupt", "damaged-trailer"}
        assert report.objects_indexed == 4  # 3 data + the meta node
        assert not store.has(ids[1]) and store.get(ids[2]).payload
        # the root's DAG is incomplete, but the rest of it reads: repair keeps it (issue 23)
        assert set(store.roots()) == {"r"}
        assert [(r.action, r.lost) for r in report.roots] == [("damaged", (ids[1],))]
        assert any(p.what == "damaged-root" for p in report.damaged)
        skipped = [p for p in report.damaged if p.what == "corrupt"]
        assert [(p.oid, p.offset) for p in skipped] == [(ids[1], victim.offset)]

def test_repair_rolls_a_damaged_root_back_and_keeps_the_others(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            old = w.put(1, b"old target")
            w.set_root("a", old)
            w.set_root("b", w.put(1, b"b target"))
        with store.writer() as w:
            new = w.put(1, os.urandom(4000))
            w.set_root("a", new)
        with store.writer() as w:
            w.set_root("c", w.put(1, b"c target"))
        lost = store._lookup(new).pack
        expect_b, expect_c = store.root("b"), store.root("c")
    list_pack_files(path)[lost].unlink()
    with engine.open(path) as store:
        report = store.repair()
        assert store.roots() == {"a": old, "b": expect_b, "c": expect_c}
        assert [p.what for p in report.damaged] == ["missing-pack", "root-rolled-back"]
        assert report.damaged[0].pack == pack_name(lost)
        assert store.verify(deep=True).ok

def test_open_finishes_a_repair_swap_a_crash_interrupted(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            w.set_root("r", w.put(1, b"kept"))
    # crash between repair's renames: index -> index.old done, index.new -> index not yet
    shutil.copytree(path / "index", path / "index.new")
    os.replace(path / "index", path / "index.old")
    with engine.open(path) as store:
        assert store.get(store.root("r")).payload == b"kept"
    assert sorted(p.name for p in path.iterdir()) == ["index", "lock", "packs"]
    # a repair that died while writing index.new leaves it beside the live index
    shutil.copytree(path / "index", path / "index.new")
    with engine.open(path) as store:
        assert store.root("r") is not None
    assert not (path / "index.new").exists()

def test_writer_skips_pack_numbers_a_crash_left_behind(pack_store):
    leftover = pack_store.path / "packs" / "00" / "00000000.pack"
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b"CNRP unsealed junk from a crash")
    with pack_store.writer() as w:
        oid = w.put(1, b"fresh")
        w.set_root("r", oid)
    assert pack_store._lookup(oid).pack == 1
    assert leftover.read_bytes().startswith(b"CNRP unsealed")
    assert pack_store.gc().packs_deleted == 1 and not leftover.exists()
    assert pack_store.get(oid).payload == b"fresh"

def test_stats_and_progress(pack_store):
    with pack_store.writer() as w:
        ids = put_chain(w, 3, 1000)
        w.set_root("r", ids[-1])
    st_ = pack_store.stats()
    assert (st_.objects, st_.roots, st_.packs) == (4, 1, 2)
    assert st_.logical_bytes == 3000 + len(b"node0")
    assert st_.stored_bytes >= 3000  # random leaves stay raw; allocated blocks
    seen = []
    pack_store.verify(deep=True, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (4, 4)
    steps = []
    pack_store.gc(progress=lambda done, total: steps.append((done, total)))
    assert steps[-1] == (3, 3)


def test_repair_recovers_the_records_of_a_pack_whose_header_is_damaged(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            ids = put_chain(w, 3, 700)
            w.set_root("r", ids[-1])
        for pack in list_pack_files(path).values():
            raw = bytearray(pack.read_bytes())
            raw[0:4] = b"JUNK"
            pack.write_bytes(bytes(raw))
        report = store.repair()
        assert [p.what for p in report.damaged] == ["corrupt-pack", "corrupt-pack"]
        assert store.roots() == {"r": ids[-1]} and report.objects_indexed == 4
        assert store.info(ids[-1]).meta and not store.info(ids[0]).meta
        rnd = random.Random(0)  # put_chain's leaves, regenerated
        assert [store.get(i).payload for i in ids[:3]] == [rnd.randbytes(700) for _ in ids[:3]]


@pytest.mark.slow
def test_maintenance_at_scale(tmp_path):
    """50k objects under segment nodes: gc halves them, verify and repair agree."""
    rnd = random.Random(0)
    with engine.open(tmp_path / "s", pack_target_size=4 << 20) as store:
        with store.writer() as w:
            ids = [w.put(1, rnd.randbytes(200)) for _ in range(50_000)]
            segs = [w.put(2, b"seg%d" % i, ids[i : i + 1000], meta=True)
                    for i in range(0, 50_000, 1000)]
            w.set_root("a", w.put(3, b"root", segs[:25], meta=True))
            w.set_root("b", w.put(3, b"root", segs[25:], meta=True))
        with store.writer() as w:
            w.delete_root("b")
        report = store.gc()
        assert (report.objects_live, report.objects_freed) == (25_026, 25_026)
        assert store.verify(deep=True).ok
        rep = store.repair()
        assert (rep.objects_indexed, rep.roots_restored, rep.damaged) == (25_026, 1, ())
        assert store.get(ids[0]).payload == random.Random(0).randbytes(200)


# -- issue 23: a repair never makes readable data unreadable -----------------------------

def _records(pack: pathlib.Path):
    from engine.packs.pack import read_trailer, scan_records

    return list(scan_records(pack.read_bytes(), name=pack.name,
                             entries=read_trailer(pack, name=pack.name)))


def test_repair_still_drops_a_root_whose_commit_never_completed(tmp_path):
    # The index published commit 1; commit 2's roots record reached the packs but its data
    # did not (a power cut between the packs' writes and the index transaction): showing
    # "n" would show a commit that never was. The index says so by its commit_seq.
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            w.set_root("a", w.put(1, b"a target"))
        shutil.copytree(path / "index", tmp_path / "index.before")
        with store.writer() as w:
            lost = w.put(1, os.urandom(3000))
            w.set_root("n", w.put(2, b"node", [lost], meta=True))
            w.set_root("a", w.put(1, b"a moved"))
        victim = store._lookup(lost).pack
    list_pack_files(path)[victim].unlink()
    shutil.rmtree(path / "index")
    shutil.copytree(tmp_path / "index.before", path / "index")
    with engine.open(path, create=False) as store:  # stale: open rebuilds it
        assert store.opened_with_repair is not None
        # "a moved" lay in the lost pack too: "a" goes back to what the index had
        assert set(store.roots()) == {"a"} and store.get(store.root("a")).payload == b"a target"
        a, n = store.opened_with_repair.roots
        assert (a.name, a.action, n.name, n.action, n.lost) == (
            "a", "rolled-back", "n", "dropped", (lost,))
        assert "never completed" in n.reason


def test_repair_indexes_a_record_whose_only_damage_is_its_checksum(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            oid = w.put(1, os.urandom(700))
            w.set_root("r", w.put(2, b"n", [oid], meta=True))
        e = store._lookup(oid)
    pack = list_pack_files(path)[e.pack]
    raw = bytearray(pack.read_bytes())
    raw[e.offset + e.length - 2] ^= 4  # inside the record's checksum field
    pack.write_bytes(bytes(raw))
    with engine.open(path) as store:
        report = store.repair()
        assert [p.what for p in report.damaged] == ["bad-checksum"]
        assert report.damaged[0].oid == oid and report.roots == ()
        with store.writer() as w:  # the id proves the content: the object is there
            assert w.has(oid)


def test_repair_takes_the_roots_from_an_intact_index_when_roots_records_are_lost(tmp_path):
    # The newest roots record (a delta naming "c") is damaged: replaying the others alone
    # would forget "c", although the index, current and checksummed, still names it.
    path = tmp_path / "s"
    with engine.open(path) as store:
        for name in "abc":
            with store.writer() as w:
                w.set_root(name, w.put(1, name.encode() * 50))
        expect = store.roots()
    meta = max(p for p in list_pack_files(path).values()
               if any(r.record and r.record.header.rtype != 0 for r in _records(p)))
    rec = next(r for r in _records(meta) if r.record and r.record.header.rtype != 0)
    raw = bytearray(meta.read_bytes())
    raw[rec.offset + rec.record.header.length - 12] ^= 1  # inside its payload
    meta.write_bytes(bytes(raw))
    with engine.open(path) as store:
        plan = store.repair(dry_run=True)
        assert plan.dry_run and plan.roots_restored == 3
        report = store.repair()
        assert store.roots() == expect
        assert "roots-from-index" in [p.what for p in report.damaged]
        with store.writer() as w:  # the chain restarts with a full snapshot
            w.set_root("d", w.put(1, b"d"))
    shutil.rmtree(path / "index")
    with engine.open(path) as store:  # rebuilt from the packs alone: the new snapshot
        assert set(store.roots()) == {"a", "b", "c", "d"}


def test_repair_dry_run_writes_nothing(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            ids = [w.put(1, os.urandom(400)) for _ in range(3)]
            w.set_root("r", w.put(2, b"n", ids, meta=True))
        e = store._lookup(ids[0])
    pack = list_pack_files(path)[e.pack]
    raw = bytearray(pack.read_bytes())
    raw[e.offset + 80] ^= 1
    pack.write_bytes(bytes(raw))
    from engine.store.repair import plan_at

    def files() -> dict[pathlib.Path, bytes]:
        return {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}

    before = files()
    at = plan_at(path)  # not even LMDB's reader table is touched
    assert files() == before
    with engine.open(path, create=False, readonly=True) as store:
        plan = store.repair(dry_run=True)
    after = files()
    lock = path / "index" / "lock.mdb"  # a read-only handle registers there as a reader
    assert {k: v for k, v in after.items() if k != lock} == {
        k: v for k, v in before.items() if k != lock}
    assert at.roots == plan.roots
    [r] = plan.roots
    assert (r.name, r.action, r.lost, r.branches) == ("r", "damaged", (ids[0],),
                                                     ((ids[0], (ids[0],)),))
    assert r.node is not None and r.node.payload == b"n"


def test_repair_brings_back_roots_an_earlier_repair_dropped(tmp_path):
    # The index an earlier repair wrote lacks roots it dropped (issue 23: every step of a
    # store with one bad data byte), with a roots checksum to match and the newest
    # commit_seq. The packs' roots records still name them: a repair keeps them.
    from engine.index import db as ix

    path = tmp_path / "s"
    with engine.open(path) as store:
        for name in "abc":
            with store.writer() as w:
                w.set_root(name, w.put(1, name.encode() * 50))
        expect = store.roots()
        index = store._core.index

        def drop_b(txn):
            txn.delete(b"b", db=index.roots)
            txn.put(ix.META_ROOTS_SUM, ix.roots_digest({k.encode(): v for k, v in
                                                        expect.items() if k != "b"}),
                    db=index.meta)

        index.write(drop_b)
    with engine.open(path) as store:
        assert set(store.roots()) == {"a", "c"}
        report = store.repair()
        assert store.roots() == expect
        assert [p.what for p in report.damaged] == ["root-not-in-index"]

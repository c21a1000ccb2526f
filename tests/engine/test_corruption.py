"""Damage on disk: a flipped byte in a pack, a truncated pack, a missing pack, a damaged
or lost LMDB index. Each must give a clear error naming what is damaged (get raises
CorruptObject / ObjectNotFound with id, pack and offset; verify reports it without
raising), must not spoil reads of undamaged objects, and repair must rebuild the index
from what the packs still hold.
"""

from __future__ import annotations

import random
import shutil

import pytest
from _helpers import (
    check_dag,
    dag,
    find_in_packs,
    open_store,
    pack_files,
    put_dag,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import CorruptObject, ObjectNotFound, StoreError
from engine.format.ids import ID_SIZE, hexid
from engine.format.records import PACK_HEADER, RECORD_HEADER

SIZE = 50_000  # random leaves: stored raw, so their bytes can be found in the packs
ROOTS = (0, 1, 2)


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "store"
    with open_store(path) as store:
        for i in ROOTS:
            with store.writer() as w:
                put_dag(w, i, size=SIZE)
    return path


def _victim(i: int = 1, leaf: int = 1) -> tuple[bytes, bytes]:
    """(id, payload) of a data leaf private to root r{i}."""
    _, objs = dag(i, size=SIZE)
    oid = list(objs)[leaf]
    return oid, objs[oid].payload


def _names_the_damage(exc: StoreError, oid: bytes, pack_file) -> None:
    text = str(exc)
    assert hexid(oid) in text, f"message does not name the object: {text}"
    assert exc.oid == oid
    assert exc.pack is not None and exc.pack in str(pack_file), (exc.pack, pack_file)
    assert exc.pack in text
    assert isinstance(exc.offset, int) and exc.offset >= 0


def _problems_for(report, oid: bytes) -> list:
    return [p for p in report.problems if p.oid == oid]


def test_flipped_byte_in_a_payload(store_path):
    oid, payload = _victim()
    pack, at = find_in_packs(store_path, payload[1000:1032])
    data = bytearray(pack.read_bytes())
    data[at + 7] ^= 0x20
    pack.write_bytes(bytes(data))
    with open_store(store_path) as store:
        with pytest.raises(CorruptObject) as info:
            store.get(oid)
        _names_the_damage(info.value, oid, pack)
        # The record starts before the payload: the offset is the record's, not the byte's.
        assert info.value.offset <= at
        report = store.verify(deep=True)
        assert not report.ok
        [problem] = report.problems
        assert problem.what == "corrupt" and problem.oid == oid
        assert problem.pack == info.value.pack and problem.offset == info.value.offset
        # Structure is intact, only a re-read finds it; the other roots are untouched.
        assert store.verify(deep=False).ok
        assert store.verify(deep=True, roots=["r0", "r2"]).ok
        check_dag(store, 0, size=SIZE)
        check_dag(store, 2, size=SIZE)


def test_flipped_byte_in_a_record_header(store_path):
    oid, _ = _victim(2, 2)
    pack, at = find_in_packs(store_path, oid)  # the id sits in the record header
    data = bytearray(pack.read_bytes())
    data[at - 3] ^= 0xFF  # in the lengths just before the id
    pack.write_bytes(bytes(data))
    with open_store(store_path) as store:
        with pytest.raises(CorruptObject) as info:
            store.get(oid)
        _names_the_damage(info.value, oid, pack)
        assert _problems_for(store.verify(deep=True), oid)


def _truncate_in_victim(store_path):
    oid, payload = _victim(2, 3)
    pack, at = find_in_packs(store_path, payload[:64])
    with open(pack, "r+b") as f:
        f.truncate(at + 100)  # cut inside the victim's payload: it and all after are gone
    return oid, pack


def test_swapped_valid_records_are_caught_by_the_id_check(store_path):
    # Two intact records of equal length trade places (what a stale index pointing into a
    # rewritten pack would see): checksums pass, so only the id check stands between a
    # get and the wrong bytes.
    _, objs = dag(1, size=SIZE)
    a, b = list(objs)[1:3]
    with open_store(store_path) as store:
        length = store.info(a).stored_len
        assert store.info(b).stored_len == length
    id_at = RECORD_HEADER.size - ID_SIZE  # the id closes the record header
    pack, at_a = find_in_packs(store_path, a)
    pack_b, at_b = find_in_packs(store_path, b)
    assert pack == pack_b
    start_a, start_b = at_a - id_at, at_b - id_at
    raw = bytearray(pack.read_bytes())
    rec_a, rec_b = raw[start_a : start_a + length], raw[start_b : start_b + length]
    raw[start_a : start_a + length], raw[start_b : start_b + length] = rec_b, rec_a
    pack.write_bytes(bytes(raw))
    with open_store(store_path) as store:
        for oid in (a, b):
            with pytest.raises(CorruptObject) as info:
                store.get(oid)
            _names_the_damage(info.value, oid, pack)
        report = store.verify(deep=True)
        assert {p.oid for p in report.problems} == {a, b}
        store.repair()  # the records are intact: repair re-indexes them where they are
        for oid in (a, b):
            assert store.get(oid) == objs[oid]
        assert store.verify(deep=True).ok


def test_truncated_pack(store_path):
    oid, pack = _truncate_in_victim(store_path)
    with open_store(store_path) as store:
        with pytest.raises(CorruptObject) as info:
            store.get(oid)
        assert info.value.pack is not None and info.value.pack in str(pack)
        assert info.value.pack in str(info.value) and "truncated" in str(info.value)
        report = store.verify(deep=False)  # a stat() is enough to see it
        assert not report.ok
        problem = _problems_for(report, oid)[0]
        assert problem.what == "truncated" and problem.pack == info.value.pack
        assert hexid(oid) in problem.message
        check_dag(store, 0, size=SIZE)
        check_dag(store, 1, size=SIZE)

        rep = store.repair()
        assert any(p.pack == info.value.pack for p in rep.damaged), rep.damaged
        # Records before the cut are still indexed; the victim is gone, but r2 stays: the
        # rest of its DAG still reads (issue 23: a repair never makes data unreadable).
        assert not store.has(oid)
        top, objs = dag(2, size=SIZE)
        assert store.root("r2") == top
        assert [(r.name, r.action, r.lost) for r in rep.roots] == [("r2", "damaged", (oid,))]
        assert all(store.get(o) == obj for o, obj in objs.items() if o != oid)
        check_dag(store, 0, size=SIZE)
        check_dag(store, 1, size=SIZE)
        assert {p.oid for p in store.verify(deep=True).problems} == {oid}


def test_truncated_pack_error_names_the_object(store_path):
    oid, pack = _truncate_in_victim(store_path)
    with open_store(store_path) as store:
        with pytest.raises(CorruptObject) as info:
            store.get(oid)
        _names_the_damage(info.value, oid, pack)


def test_missing_pack(store_path):
    oid, payload = _victim(1, 1)
    pack, _ = find_in_packs(store_path, payload[:64])
    pack.unlink()
    with open_store(store_path) as store:
        with pytest.raises((CorruptObject, ObjectNotFound)) as info:
            store.get(oid)
        _names_the_damage(info.value, oid, pack)
        assert "missing" in str(info.value)
        report = store.verify()
        problem = _problems_for(report, oid)[0]
        assert problem.what == "missing-pack" and problem.pack in str(pack)
        check_dag(store, 0, size=SIZE)
        check_dag(store, 2, size=SIZE)


def test_repair_keeps_every_intact_root(store_path):
    # One damaged root must not take down roots committed after it (an earlier repair
    # fell back to the newest snapshot whose every root was complete, dropping r2 too),
    # nor itself: r1 lost one leaf and keeps the rest (a later repair dropped r1).
    oid, payload = _victim(1, 1)
    pack, _ = find_in_packs(store_path, payload[:64])
    pack.unlink()
    with open_store(store_path) as store:
        rep = store.repair()
        check_dag(store, 0, size=SIZE)
        check_dag(store, 2, size=SIZE)
        top, objs = dag(1, size=SIZE)
        assert store.root("r1") == top
        lost = {o for o in objs if not store.has(o)}  # all that lay in the deleted pack
        assert oid in lost and top not in lost
        assert all(store.get(o) == obj for o, obj in objs.items() if o not in lost)
        assert [set(r.lost) for r in rep.roots if r.name == "r1"] == [lost]
        with pytest.raises(ObjectNotFound, match=hexid(oid)):
            store.get(oid)
        assert any(p.what == "damaged-root" and "r1" in p.message for p in rep.damaged)


def test_repair_rolls_a_damaged_root_back_to_its_last_intact_target(store_path):
    # r1 moves from DAG 1 to DAG 5; DAG 5 is then damaged: r1 goes back to DAG 1.
    with open_store(store_path) as store:
        with store.writer() as w:
            top5 = put_dag(w, 5, size=SIZE, root=False)
            w.set_root("r1", top5)
    _, objs = dag(5, size=SIZE)
    victim = list(objs)[2]
    pack, _ = find_in_packs(store_path, objs[victim].payload[:64])
    pack.unlink()
    with open_store(store_path) as store:
        assert store.root("r1") == top5
        store.repair()
        assert store.root("r1") == top5  # DAG 5 partly reads: kept, not rolled back
    top, objs = dag(5, size=SIZE)
    assert top == top5
    pack, _ = find_in_packs(store_path, objs[top].payload[:64])
    pack.unlink()  # now DAG 5's top itself is lost: nothing of it reads
    with open_store(store_path) as store:
        rep = store.repair()
        check_dag(store, 1, size=SIZE)  # r1 points at DAG 1's top again, intact
        # (that pack held the roots record moving r1 to DAG 5 too: the index names top5,
        # but the packs do not hold it, so the replay's older target stands; both said)
        assert {p.what for p in rep.damaged} == {"missing-pack", "root-rolled-back"}
        check_dag(store, 0, size=SIZE)
        check_dag(store, 2, size=SIZE)
        assert store.verify(deep=True).ok


def test_lost_index_is_rebuilt_on_open(store_path):
    shutil.rmtree(store_path / "index")
    with open_store(store_path) as store:
        assert set(store.roots()) == {f"r{i}" for i in ROOTS}
        for i in ROOTS:
            check_dag(store, i, size=SIZE)
        assert store.verify(deep=True).ok
        stats = store.stats()
        assert stats.objects == len(ROOTS) * 4 + 1
        assert stats.packs == len(pack_files(store_path))


def test_garbled_index_header_is_rebuilt_from_the_packs(store_path):
    # Both LMDB meta pages garbled: the map is never handed to LMDB (a meta page naming
    # pages past the end of the file would SIGBUS); open rebuilds it from the packs.
    data_mdb = store_path / "index" / "data.mdb"
    raw = bytearray(data_mdb.read_bytes())
    raw[:8192] = random.Random(1).randbytes(8192)  # both LMDB meta pages
    data_mdb.write_bytes(bytes(raw))
    with open_store(store_path) as store:
        assert store.opened_with_repair is not None
        for i in ROOTS:
            check_dag(store, i, size=SIZE)
        assert store.verify(deep=True).ok


def test_garbled_index_pages_then_repair(store_path):
    data_mdb = store_path / "index" / "data.mdb"
    raw = bytearray(data_mdb.read_bytes())
    tail = 4096 * 6  # B-tree pages, not the meta pages
    raw[-tail:] = random.Random(2).randbytes(tail)
    data_mdb.write_bytes(bytes(raw))
    # Which pages the garbage hits depends on the index layout: the store either refuses
    # to open or fails its reads, always with its own error (never lmdb's, never a crash).
    try:
        store = open_store(store_path)
    except StoreError as exc:
        assert "index" in str(exc)
        shutil.rmtree(store_path / "index")
        store = open_store(store_path)  # rebuilt from the packs on open
    else:
        if store.opened_with_repair is None:  # open found nothing wrong: reads do
            with pytest.raises(StoreError):
                for i in ROOTS:
                    check_dag(store, i, size=SIZE)
        rep = store.repair()
        assert rep.objects_indexed == len(ROOTS) * 4 + 1
        assert rep.roots_restored == len(ROOTS)
        assert rep.damaged == ()
    with store:
        assert set(store.roots()) == {f"r{i}" for i in ROOTS}
        for i in ROOTS:
            check_dag(store, i, size=SIZE)
        assert store.verify(deep=True).ok


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A small store (small leaves, compressible nodes) copied afresh for each example."""
    path = tmp_path_factory.mktemp("template") / "store"
    with open_store(path) as store:
        for i in ROOTS:
            with store.writer() as w:
                put_dag(w, i, size=2000)
    return path


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_bit_is_caught_never_returned(template, tmp_path_factory, data):
    """Flip one bit anywhere in any pack past its header: every get returns the right
    object or raises CorruptObject / ObjectNotFound (never wrong bytes, never another
    error); deep verify flags the damaged object; repair keeps every object the flip did
    not touch."""
    path = tmp_path_factory.mktemp("flip") / "store"
    shutil.copytree(template, path)
    packs = pack_files(path)
    pack = data.draw(st.sampled_from(packs))
    raw = bytearray(pack.read_bytes())
    at = data.draw(st.integers(PACK_HEADER.size, len(raw) - 1))  # header: see below
    raw[at] ^= 1 << data.draw(st.integers(0, 7))
    pack.write_bytes(bytes(raw))
    want = {}
    for i in ROOTS:
        want.update(dag(i, size=2000)[1])
    with open_store(path) as store:
        bad = set()
        for oid, obj in want.items():
            try:
                assert store.get(oid) == obj
            except (CorruptObject, ObjectNotFound) as exc:
                assert exc.oid == oid
                bad.add(oid)
        report = store.verify(deep=True)
        assert {p.oid for p in report.problems if p.oid in want} == bad
        assert len(bad) <= 1  # one flipped bit damages at most one record
        store.repair()
        for oid, obj in want.items():
            if oid not in bad:
                assert store.get(oid) == obj
        for i in ROOTS:  # every root whose own object survived is kept where it was
            top = dag(i, size=2000)[0]
            if top not in bad:
                assert store.root(f"r{i}") == top
        assert {p.oid for p in store.verify(deep=True).problems} <= bad


def test_repair_recovers_records_of_a_pack_with_a_damaged_magic(store_path):
    # (An earlier repair skipped the whole pack on a bad header, losing all its objects.)
    # The records are intact and self-describing (each has its own magic, version and
    # checksum), so repair must index them all again. (A changed version byte is another
    # matter: it cannot be told from a pack of a newer format, which must be refused.)
    oid, payload = _victim(1, 1)
    pack, _ = find_in_packs(store_path, payload[:64])
    raw = bytearray(pack.read_bytes())
    raw[0] ^= 0x01
    pack.write_bytes(bytes(raw))
    with open_store(store_path) as store:
        assert store.get(oid).payload == payload  # reads never look at the header
        rep = store.repair()
        assert any(p.pack and p.pack in str(pack) for p in rep.damaged), rep.damaged
        for i in ROOTS:
            check_dag(store, i, size=SIZE)
        assert store.verify(deep=True).ok

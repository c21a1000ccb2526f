"""The engine side of the distributed commit (docs/FORMAT.md "Distributed commit"):
PackSink, reserve_packs and leases, adopt, locate, LocatedReader / LocatedObjects, and how
gc, repair and the freshness check treat rank packs. Real files and LMDB throughout;
process-level kills are in test_dist_procs.py."""

from __future__ import annotations

import os
import pickle
import tempfile

import msgpack
import pytest
from _helpers import make_payload, pack_files
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine import (
    EngineOptions,
    LocatedObjects,
    LocatedReader,
    PacksExhausted,
    PackSink,
    RecordLocation,
    packs_needed,
    record_bound,
)
from engine.errors import (
    CorruptObject,
    FormatError,
    NotSupported,
    ObjectNotFound,
    PackMoved,
    ReadOnly,
    StoreError,
    StoreLocked,
)
from engine.format.ids import object_id
from engine.packs.pack import pack_path
from engine.store.freshness import stale_problem


def objects_for(seed: int, n: int = 4, size: int = 6000) -> list[tuple[int, bytes, tuple]]:
    """``n`` leaves (compressible and not, one >= 64 KiB to take the sampling path) and a
    meta node over them."""
    out, ids = [], []
    for k in range(n):
        if k == 1:
            payload = b"z" * (70 << 10) + seed.to_bytes(8, "little")  # compressible, sampled
        elif k == 2:
            payload = make_payload(seed * 100 + k, 80 << 10)  # incompressible, sampled
        else:
            payload = make_payload(seed * 100 + k, size)
        out.append((1, payload, ()))
        ids.append(object_id(1, (), payload))
    out.append((2, make_payload(seed, 64), tuple(ids)))
    return out


def sink_write(store, objs, *, npacks: int = 4) -> tuple[range, list[RecordLocation]]:
    packs = store.reserve_packs(npacks)
    sink = PackSink(store.path, packs, store.options)
    for kind, payload, refs in objs:
        sink.put(kind, payload, refs, meta=kind == 2)
    return packs, sink.seal()


def record_bytes(store, oid: bytes) -> bytes:
    e = store._core.lookup(oid)
    with open(pack_path(store.path, e.pack), "rb") as f:
        f.seek(e.offset)
        return f.read(e.length)


def index_state(store) -> tuple[dict, set, dict]:
    index = store._core.index

    def read(txn):
        packs = {bytes(k): bytes(v) for k, v in txn.cursor(db=index.packs)}
        objs = {bytes(k) for k, _ in txn.cursor(db=index.objects)}
        return packs, objs

    packs, objs = index.read(read)
    return store.roots(), objs, packs


@pytest.mark.parametrize("level", [0, 3, 19])
def test_sink_records_are_byte_identical_to_the_writers(tmp_path, level):
    objs = objects_for(1)
    with engine.open(tmp_path / "a", compression_level=level) as a, \
            engine.open(tmp_path / "b", compression_level=level) as b:
        with a.writer() as w:
            ids_a = [w.put(k, p, r, meta=k == 2) for k, p, r in objs]
        _, locs = sink_write(b, objs)
        assert [loc.oid for loc in locs] == ids_a
        with b.writer() as w:
            w.adopt(locs)
        for oid in ids_a:
            assert record_bytes(a, oid) == record_bytes(b, oid)
            assert a.info(oid) == b.info(oid)


def test_adopt_commits_and_every_maintenance_path_agrees(tmp_path):
    path = tmp_path / "s"
    with engine.open(path, pack_target_size=64 << 10) as store:
        _, locs1 = sink_write(store, objects_for(1))
        _, locs2 = sink_write(store, objects_for(2))
        tops = [locs1[-1].oid, locs2[-1].oid]
        with store.writer() as w:
            w.adopt(locs1)
            w.adopt(locs2)
            assert w.has(tops[0]) and w.payload_bytes_new > 0
            top = w.put(3, b"step", tops, meta=True)
            w.create_root("step/1", top)
        assert store.verify(deep=True).ok
        closure = store.locate_closure([top])
        assert set(closure) == {top, *(loc.oid for loc in locs1 + locs2)}
        for loc in locs1 + locs2:
            assert closure[loc.oid] == loc
            assert store.get(loc.oid).refs == loc.refs
        before = index_state(store)
        store.repair()
        assert index_state(store) == before  # described exactly as a rebuild sees them
        assert store.verify(deep=True).ok
        # gc keeps the adopted objects a root reaches and reclaims the others.
        with store.writer() as w:
            w.set_root("step/1", tops[0])
        rep = store.gc(threshold=0.0)
        assert rep.objects_freed >= 4  # step 2's own leaves, its node and the step node
        assert store.verify(deep=True).ok
        for loc in locs1:
            assert store.has(loc.oid)
        assert not store.has(tops[1]) and not store.has(top)


def test_adopt_dedups_against_the_store_the_writer_and_other_sinks(pack_store):
    objs = objects_for(1)
    _, locs_a = sink_write(pack_store, objs)
    _, locs_b = sink_write(pack_store, objs)  # another rank wrote the same objects
    with pack_store.writer() as w:
        w.adopt(locs_a)
        w.adopt(locs_b)
    w = pack_store.writer()
    w.adopt(locs_b)  # all stored now: nothing new
    w.set_root("r", locs_b[-1].oid)
    info = w.commit()
    assert info.objects_new == 0 and info.objects_reused == len(locs_b)
    assert pack_store.verify(deep=True).ok
    assert pack_store.gc(threshold=0.0).objects_live == len(objs)
    assert pack_store.verify(deep=True).ok


def _refused(store, locs, exc_type, match):
    roots, objs, packs = index_state(store)
    w = store.writer()
    with pytest.raises(exc_type, match=match):
        w.adopt(locs)
        w.set_root("x", locs[-1].oid)
        w.commit()
    w.abort()
    assert index_state(store) == (roots, objs, packs)  # nothing published


def test_adopt_refuses_an_unsealed_pack(pack_store):
    packs = pack_store.reserve_packs(4)
    sink = PackSink(pack_store.path, packs, pack_store.options)
    for kind, payload, refs in objects_for(1):
        sink.put(kind, payload, refs, meta=kind == 2)
    _refused(pack_store, sink.locations, CorruptObject, "not sealed")


@pytest.mark.parametrize("field,value", [
    ("offset", 17), ("length", 99), ("kind", 9), ("raw_len", 5), ("meta", True),
    ("refs", (b"\1" * 16,)), ("oid", b"\2" * 16),
])
def test_adopt_refuses_a_location_that_does_not_match_the_pack(pack_store, field, value):
    _, locs = sink_write(pack_store, objects_for(1))
    bad = {**locs[0].__dict__, field: value}
    _refused(pack_store, [*locs[1:], RecordLocation(**bad)], CorruptObject, "cannot adopt")


def test_adopt_refuses_a_dangling_ref(pack_store):
    packs = pack_store.reserve_packs(2)
    sink = PackSink(pack_store.path, packs, pack_store.options)
    sink.put(2, b"node", [b"\7" * 16], meta=True)
    _refused(pack_store, sink.seal(), ObjectNotFound, "dangling")


def test_adopt_refuses_packs_that_were_never_reserved(pack_store):
    with pack_store.writer() as w:
        oid = w.put(1, b"committed")
    loc = pack_store.locate([oid])[oid]
    _refused(pack_store, [RecordLocation(b"\3" * 16, *list(loc.__dict__.values())[1:])],
             StoreError, "not a reserved pack")


def test_reservations_are_durable_and_never_reused(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        first = store.reserve_packs(3)
        with store.writer() as w:
            w.put(1, b"x")
        second = store.reserve_packs(2)
        with pytest.raises(StoreLocked):
            with store.writer():
                store.reserve_packs(1)  # would wait on its own writer lock
        used = {int(p.stem) for p in pack_files(path)}
    assert len(first) == 3 and second.start >= first.stop
    assert not used & set(first) and not used & set(second)
    with engine.open(path) as store:  # durable: a new handle reserves after them
        assert store.reserve_packs(1).start >= second.stop
        live = store.reserve_packs(5)
        with engine.open(path) as other:
            other.repair()  # even a rebuild keeps next_pack past a live lease
            assert other.reserve_packs(1).start >= live.stop


def test_gc_spares_leased_rank_packs_and_reclaims_them_after(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            w.set_root("keep", w.put(1, b"keep"))
        packs, locs = sink_write(store, objects_for(1))
        files = [pack_path(path, n) for n in {loc.pack for loc in locs}]
        with engine.open(path) as other:  # another handle (own flock) runs gc
            other.gc(threshold=0.0)
            assert all(f.exists() for f in files)
            store.release_packs(packs)
            rep = other.gc(threshold=0.0)
        assert not any(f.exists() for f in files)
        assert rep.bytes_freed > 0 and rep.packs_deleted == len(files)
        assert store.verify(deep=True).ok and store.root("keep") is not None


def test_lease_ends_with_the_adopting_writer_even_on_abort(pack_store):
    _, locs = sink_write(pack_store, objects_for(1))
    w = pack_store.writer()
    w.adopt(locs)
    w.abort()
    pack_store.gc(threshold=0.0)
    assert not any(pack_path(pack_store.path, loc.pack).exists() for loc in locs)


@pytest.mark.parametrize("committed", [False, True])
def test_orphan_rank_packs_do_not_make_the_index_stale(tmp_path, committed):
    path = tmp_path / "s"
    with engine.open(path) as store:
        if committed:
            with store.writer() as w:
                w.set_root("r", w.put(1, b"r"))
        sink_write(store, objects_for(1))  # never adopted; lease ends at close
    for _ in range(2):
        with engine.open(path) as store:
            assert store.opened_with_repair is None
            assert stale_problem(store._core) is None
    with engine.open(path) as store:
        rep = store.gc(threshold=0.0)
        assert rep.packs_deleted >= 2 and rep.bytes_freed > 0
        assert store.verify(deep=True).ok
        assert set(store.roots()) == ({"r"} if committed else set())


def test_repair_indexes_orphans_as_unreachable_then_gc_sweeps_them(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        packs, locs = sink_write(store, objects_for(1))
        store.release_packs(packs)
        rep = store.repair()
        assert rep.objects_indexed == len(locs) and rep.roots_restored == 0
        assert store.gc(threshold=0.0).objects_freed == len(locs)
        assert not pack_files(path)


def test_located_reader_reads_checks_and_reports_moved_packs(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            a = w.put(1, make_payload(1, 5000))
            b = w.put(1, make_payload(2, 5000))
            w.set_root("a", a)
            w.set_root("b", b)
        locs = store.locate([a, b, b"\0" * 16])
        assert set(locs) == {a, b}
        with LocatedReader(path) as reader:
            assert reader.read(locs[a]) == store.get(a)
            assert [o.payload for o in reader.get_many([locs[b], locs[a]])] == [
                store.get(b).payload, store.get(a).payload]
            with pytest.raises(CorruptObject):  # another object's place
                reader.read(RecordLocation(a, *list(locs[b].__dict__.values())[1:]))
            with store.writer() as w:
                w.delete_root("b")
            store.gc(threshold=0.0)  # rewrites the pack: a moves
            with LocatedReader(path) as fresh:
                with pytest.raises(PackMoved) as exc:
                    fresh.read(locs[a])
                assert isinstance(exc.value, ObjectNotFound)
                assert fresh.read(store.locate([a])[a]) == store.get(a)


def test_located_objects_is_a_read_only_object_store(pack_store):
    _, locs = sink_write(pack_store, objects_for(1))
    with pack_store.writer() as w:
        w.adopt(locs)
        w.set_root("r", locs[-1].oid)
    located = pack_store.locate_closure([locs[-1].oid])
    with LocatedReader(pack_store.path) as reader:
        view = LocatedObjects(reader, located, pack_store.roots())
        assert isinstance(view, engine.ObjectStore)
        for oid in located:
            assert view.get(oid) == pack_store.get(oid)
            assert view.info(oid) == pack_store.info(oid)
            assert view.has(oid)
        assert list(view.get_many(located)) == list(pack_store.get_many(located))
        assert view.root("r") == pack_store.root("r") and view.roots() == pack_store.roots()
        assert view.verify(deep=True).ok
        assert not view.has(b"\0" * 16)
        with pytest.raises(ObjectNotFound):
            view.get(b"\0" * 16)
        for call in (view.writer, view.gc, view.repair):
            with pytest.raises(ReadOnly):
                call()


def test_wire_forms_round_trip(pack_store):
    _, locs = sink_write(pack_store, objects_for(1))
    for loc in locs:
        for through in (pickle.dumps, lambda v: msgpack.packb(v, use_bin_type=True)):
            data = through(loc.to_wire())
            back = pickle.loads(data) if through is pickle.dumps else msgpack.unpackb(data)
            assert RecordLocation.from_wire(back) == loc
    assert engine.decode_locations(engine.encode_locations(locs)) == locs
    assert len(engine.encode_locations(locs)) < 60 * len(locs) + 16 * 4
    for bad in [(), (1, 2), (b"x", 1, b"", 0, 0, 0, 0, False),
                (b"\0" * 16, 1, b"\0" * 15, 0, 0, 0, 0, False),
                (b"\0" * 16, -1, b"", 0, 0, 0, 0, False)]:
        with pytest.raises(FormatError):
            RecordLocation.from_wire(bad)
    with pytest.raises(FormatError):
        engine.decode_locations(engine.encode_locations(locs)[:-3])
    opts = EngineOptions(compression_level=7, pack_target_size=1 << 20)
    assert EngineOptions.from_wire(msgpack.unpackb(msgpack.packb(opts.to_wire()))) == opts
    assert pickle.loads(pickle.dumps(opts)) == opts
    assert EngineOptions.from_wire({"compression_level": 1, "future": 3}).compression_level == 1


def test_sink_dedups_rolls_packs_and_stays_in_its_range(tmp_path):
    with engine.open(tmp_path / "s", pack_target_size=16 << 10) as store:
        packs = store.reserve_packs(3)
        sink = PackSink(store.path, packs, store.options)
        a = sink.put(1, make_payload(1, 10_000))
        assert sink.put(1, make_payload(1, 10_000)) == a and len(sink.locations) == 1
        sink.put(1, make_payload(2, 10_000))  # rolls to a second data pack
        sink.put(2, b"node", [a], meta=True)  # the third: a meta pack
        with pytest.raises(engine.PacksExhausted):
            sink.put(1, make_payload(3, 10_000))
        assert set(sink.pack_numbers) == set(packs)
        sink.discard()
        assert not pack_files(store.path)
        with pytest.raises(engine.StoreClosed):
            sink.put(1, b"late")


def test_a_sink_skips_a_number_someone_else_holds(pack_store):
    """A number of the range that exists already (claimed by a writer on another cache,
    for a bucket) is skipped, never written into; with none left the sink says so."""
    with pack_store.writer() as w:
        w.put(1, b"x")
    taken = pack_store.locate([object_id(1, (), b"x")])
    n = next(iter(taken.values())).pack
    before = pack_store.storage.read_all(n)
    sink = PackSink(pack_store.path, range(n, n + 1), pack_store.options)
    with pytest.raises(PacksExhausted):
        sink.put(1, b"y")
    sink = PackSink(pack_store.path, range(n, n + 2), pack_store.options)
    sink.put(1, b"y")
    assert [loc.pack for loc in sink.seal()] == [n + 1]
    assert pack_store.storage.read_all(n) == before
    assert pack_store.get(object_id(1, (), b"x")).payload == b"x"


def test_the_memory_twin_says_what_it_cannot_do():
    store = engine.MemoryStore()
    with store.writer() as w:
        oid = w.put(1, b"x")
    assert store.missing([oid, b"\0" * 16]) == {b"\0" * 16}
    for call in (lambda: store.reserve_packs(1), lambda: store.locate([oid]),
                 lambda: store.locate_closure([oid])):
        with pytest.raises(NotSupported):
            call()
    w = store.writer()
    with pytest.raises(NotSupported):
        w.adopt([])
    w.abort()


def test_missing_and_locate_on_the_pack_store(pack_store):
    with pack_store.writer() as w:
        a = w.put(1, b"a")
        b = w.put(2, b"b", [a], meta=True)
    assert pack_store.missing([a, b, b"\0" * 16]) == {b"\0" * 16}
    loc = pack_store.locate([b])[b]
    assert (loc.kind, loc.refs, loc.meta, loc.raw_len) == (2, (a,), True, 1)
    assert set(pack_store.locate_closure([b])) == {a, b}
    assert os.path.exists(pack_path(pack_store.path, loc.pack))


# -- properties ---------------------------------------------------------------------------
_objects = st.lists(
    st.tuples(st.integers(1, 5), st.integers(0, 3000), st.booleans(), st.booleans(),
              st.integers(0, 3)),
    min_size=1, max_size=12)


@settings(max_examples=20, deadline=None)
@given(spec=_objects, level=st.sampled_from([0, 1, 3]), nonce=st.integers(0, 1 << 30))
def test_property_sink_and_writer_write_the_same_records(spec, level, nonce):
    """For any objects (sizes, compressible or not, meta or not, refs to earlier ones)
    and compression level, the sink's records are the writer's, byte for byte."""
    with tempfile.TemporaryDirectory() as d:
        with engine.open(f"{d}/a", compression_level=level, pack_target_size=4096) as a, \
                engine.open(f"{d}/b", compression_level=level, pack_target_size=4096) as b:
            objs, ids = [], []
            for i, (kind, size, compressible, meta, nrefs) in enumerate(spec):
                payload = (bytes([i % 7]) * size if compressible
                           else make_payload(nonce + i, size))
                refs = tuple(ids[-nrefs:]) if nrefs and ids else ()
                objs.append((kind, payload, refs, meta))
                ids.append(object_id(kind, refs, payload))
            bound = sum(record_bound(len(p), len(r)) for _, p, r, _ in objs)
            packs = b.reserve_packs(2 * packs_needed(len(objs), bound, b.options))
            sink = PackSink(b.path, packs, b.options)
            with a.writer() as w:
                for kind, payload, refs, meta in objs:
                    assert w.put(kind, payload, refs, meta=meta) == sink.put(
                        kind, payload, refs, meta=meta)
            with b.writer() as w:
                w.adopt(sink.seal())
            for oid in set(ids):
                assert record_bytes(a, oid) == record_bytes(b, oid)
            assert a.verify(deep=True).ok and b.verify(deep=True).ok


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40),
       target=st.sampled_from([1024, 2048, 4096, 10_000]))
def test_property_packs_needed_is_enough(sizes, target):
    """A range of ``packs_needed`` packs never runs out, whatever the record sizes."""
    options = EngineOptions(compression_level=0, pack_target_size=target)
    payloads = [make_payload(i, s) for i, s in enumerate(sizes)]
    bound = sum(record_bound(len(p)) for p in payloads)
    n = packs_needed(len(payloads), bound, options)
    with tempfile.TemporaryDirectory() as d:
        sink = PackSink(d, range(0, n), options)
        for p in payloads:
            sink.put(1, p)
        locs = sink.seal()
        assert sum(loc.length for loc in locs) <= bound
        assert len(sink.pack_numbers) <= n


def test_a_range_whose_records_were_all_held_already_is_released_too(pack_store):
    objs = objects_for(1)
    _, first = sink_write(pack_store, objs)
    _, dup = sink_write(pack_store, objs)  # another rank wrote the same objects
    with pack_store.writer() as w:
        w.adopt(first)
        w.set_root("r", first[-1].oid)
    with pack_store.writer() as w:
        w.adopt(dup)  # nothing new: its packs are not adopted, but the put is over
    pack_store.gc(threshold=0.0)
    assert not any(pack_path(pack_store.path, loc.pack).exists() for loc in dup)
    # The adopted records stay (gc may have merged their small packs elsewhere).
    payloads = {object_id(k, refs, p): p for k, p, refs in objs}
    assert all(pack_store.get(loc.oid).payload == payloads[loc.oid] for loc in first)
    assert pack_store.verify(deep=True).ok


def test_adopted_refs_may_resolve_to_objects_the_coordinator_puts_later(pack_store):
    leaf = b"coordinator's leaf"
    leaf_id = object_id(1, (), leaf)
    packs = pack_store.reserve_packs(2)
    sink = PackSink(pack_store.path, packs, pack_store.options)
    node = sink.put(2, b"node", [leaf_id], meta=True)
    w = pack_store.writer()
    w.adopt(sink.seal())
    assert w.put(1, leaf) == leaf_id  # resolved at commit, not at adopt
    w.set_root("r", node)
    info = w.commit()
    assert (info.objects_new, info.objects_reused) == (2, 0)
    assert pack_store.verify(deep=True).ok
    assert pack_store.get(node).refs == (leaf_id,)

"""``get_many_at``: many located records read at once, adjacent ones of a pack with one
read (engine/store/batchread.py), give what ``get_at`` gives one by one, with the same
checks: a damaged record, a moved one and a missing one read as a single read reads them."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from _helpers import open_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import CorruptObject, ObjectNotFound
from engine.format.location import RecordLocation
from engine.packs import pack as pack_mod
from engine.store.batchread import GAP, coalesce
from engine.store.memory import MemoryStore

KIND = 7


def _payload(n: int, seed: int, zeros: bool) -> bytes:
    if zeros:  # compressible: stored zstd
        return bytes(n)
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _fill(store, specs, commits: int) -> list[bytes]:
    """Objects of ``specs`` (size, compressible) put over ``commits`` commits; their ids."""
    oids: list[bytes] = []
    per = -(-len(specs) // commits)
    for c in range(0, len(specs), per):
        with store.writer() as w:
            for i, (size, zeros) in enumerate(specs[c:c + per], start=c):
                oids.append(w.put(KIND, _payload(size, i, zeros)))
    return oids


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.tuples(st.integers(0, 40_000), st.booleans()), min_size=1,
                      max_size=20),
       commits=st.integers(1, 4), data=st.data())
def test_batched_reads_match_single_reads(tmp_path_factory, specs, commits, data):
    # small packs: the records of one commit spread over several
    path = tmp_path_factory.mktemp("s") / "store"
    with open_store(path, pack_target_size=64 << 10) as store:
        oids = _fill(store, specs, commits)
        locs = store.locate(oids)
        # any order, repeats allowed: what a caller asks is what it gets, in its order
        ask = data.draw(st.lists(st.sampled_from(sorted(locs)), min_size=0, max_size=30))
        got = store.get_many_at([locs[o] for o in ask])
        assert got == [store.get_at(locs[o]) for o in ask] == [store.get(o) for o in ask]
        # payloads are bytes unless views are asked for
        assert all(type(o.payload) is bytes for o in got)
        assert all(type(store.get_at(locs[o]).payload) is bytes for o in ask)
        # hinted, payloads as views of the reads (raw records) or bytes: the same objects
        views = store.get_many_at([locs[o] for o in ask], hint=True, views=True)
        assert [(o.kind, o.refs, bytes(o.payload)) for o in views] == [
            (o.kind, o.refs, o.payload) for o in got]
        assert all(isinstance(o.payload, bytes) or o.payload.readonly for o in views)


def test_records_across_packs_are_read_in_few_spans(tmp_path):
    with open_store(tmp_path / "store", pack_target_size=64 << 10) as store:
        oids = _fill(store, [(5000, False)] * 40, 4)
        locs = list(store.locate(oids).values())
        spans = coalesce(locs[::-1])
        packs = {loc.pack for loc in locs}
        assert len(packs) > 2 and len(spans) == len(packs)
        for pack, start, _end, at in spans:
            assert all(locs[::-1][i].pack == pack for i in at)
            assert start == min(locs[::-1][i].offset for i in at)
        assert store.get_many_at(locs[::-1]) == [store.get(o) for o in oids[::-1]]


def test_each_pack_is_opened_once_and_hinted_reads_give_the_same(tmp_path, monkeypatch):
    # more packs than the descriptor LRU holds: one open a pack a call, not one a span;
    # hinted (a cold read of many packs), every span is hinted before the first read
    with open_store(tmp_path / "store", pack_target_size=64 << 10) as store:
        oids = _fill(store, [(5000, False)] * 60, 6)
        locs = list(store.locate(oids).values())
        packs = {loc.pack for loc in locs}
        want = [store.get(o) for o in oids]
        readers = store._core.readers
        monkeypatch.setattr(readers, "_max", 2)
        for n in packs:
            readers.forget(n)
        calls: list[str] = []

        def spy(name, real):
            return lambda *a, **k: (calls.append(name), real(*a, **k))[1]

        monkeypatch.setattr(os, "open", spy("open", os.open))
        monkeypatch.setattr(pack_mod, "pread_exact", spy("read", pack_mod.pread_exact))
        if hasattr(os, "posix_fadvise"):
            monkeypatch.setattr(os, "posix_fadvise", spy("hint", os.posix_fadvise))
        assert store.get_many_at(locs) == want
        assert calls.count("open") == len(packs) and "hint" not in calls
        calls.clear()
        for n in packs:
            readers.forget(n)
        assert store.get_many_at(locs, hint=True) == want
        assert calls.count("open") == len(packs)
        if hasattr(os, "posix_fadvise"):
            reads = [c for c in calls if c != "open"]
            first = reads.index("read")
            assert first >= len(packs) and "hint" not in reads[first:]


def test_records_far_apart_are_read_apart():
    a = RecordLocation(b"a" * 16, KIND, (), 0, 100, 10, 10, False)
    c = dataclasses.replace(a, oid=b"c" * 16, offset=110)  # adjacent: one read
    b = dataclasses.replace(a, oid=b"b" * 16, offset=120 + GAP + 1)
    assert [s[3] for s in coalesce([a, b, c])] == [[0, 2], [1]]
    bad = dataclasses.replace(a, oid=b"d" * 16, offset=-5)
    assert [s[3] for s in coalesce([a, bad])] == [[1], [0]]


def _damage(store, loc) -> None:
    pack = store.storage.path(loc.pack)
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + loc.length // 2] ^= 0x5A
    pack.write_bytes(bytes(raw))


@pytest.mark.parametrize("zeros", [False, True])
def test_a_damaged_record_is_refused_as_a_single_read_refuses_it(tmp_path, zeros):
    with open_store(tmp_path / "store") as store:
        oids = _fill(store, [(3000 + i, zeros) for i in range(5)], 1)
        locs = [store.locate(oids)[o] for o in oids]
        _damage(store, locs[2])
        with pytest.raises(CorruptObject) as single:
            store.get_at(locs[2])
        with pytest.raises(CorruptObject) as many:
            store.get_many_at(locs)
        assert many.value.oid == single.value.oid == oids[2]
        assert str(many.value) == str(single.value)
        # the others still read, together as alone
        rest = locs[:2] + locs[3:]
        assert store.get_many_at(rest) == [store.get(loc.oid) for loc in rest]


def test_a_truncated_pack_is_reported_as_a_single_read_reports_it(tmp_path):
    with open_store(tmp_path / "store") as store:
        oids = _fill(store, [(3000, False)] * 4, 1)
        locs = [store.locate(oids)[o] for o in oids]
        last = max(locs, key=lambda c: c.offset)
        cut = dataclasses.replace(last, length=last.length + 10 ** 6)  # past the file
        with pytest.raises(CorruptObject) as single:
            store.get_at(cut)
        with pytest.raises(CorruptObject) as many:
            store.get_many_at([*locs[:-1], cut])
        assert str(many.value) == str(single.value)


def test_moved_and_missing_records(tmp_path):
    with open_store(tmp_path / "store") as store:
        oids = _fill(store, [(3000, False)] * 4, 1)
        locs = [store.locate(oids)[o] for o in oids]
        moved = [dataclasses.replace(loc, pack=loc.pack + 1000) for loc in locs]
        # a pack a gc removed: each record looked up again, as get_at does
        assert store.get_many_at(moved) == [store.get(o) for o in oids]
        with store.writer() as w:
            w.set_root("keep", oids[0])
        store.gc(threshold=0.0)
        assert not store.has(oids[1])
        with pytest.raises(ObjectNotFound) as single:
            store.get_at(locs[1])
        with pytest.raises(ObjectNotFound) as many:
            store.get_many_at(locs)
        assert many.value.oid == single.value.oid == oids[1]


def test_memory_twin_reads_by_id():
    twin = MemoryStore()
    with twin.writer() as w:
        a, b = w.put(KIND, b"abc"), w.put(KIND, b"de")
    locs = [RecordLocation(o, KIND, (), 0, 0, 0, 3, False) for o in (b, a)]
    assert [o.payload for o in twin.get_many_at(locs)] == [b"de", b"abc"]
    with pytest.raises(ObjectNotFound):
        twin.get_many_at([RecordLocation(b"z" * 16, KIND, (), 0, 0, 0, 3, False)])

"""The rank side of a distributed put over the pack-storage interface, on a bucket (moto)
and on a shared directory (the ``bucket`` fixture runs each test on both): a rank reaches
the packs from the coordinator's locator alone (no index, no cache), writes through
``PackStorage.create`` writers, the coordinator adopts by reading trailers and record
headers through the storage, and its commit document lists the adopted packs, so a cache
elsewhere (or an empty one) learns them."""

from __future__ import annotations

import tempfile

import pytest
from _helpers import make_payload

import engine
from engine import LocatedReader, PackMoved, PackSink
from engine.format.ids import object_id
from engine.packs.storage import PackStorage
from engine.storage import attach


def rank_storage(bucket, store, staging):
    """What a rank builds: the packs of the backend the coordinator's locator names."""
    return PackStorage(attach(store.storage.locator(), staging=staging,
                              storage_options=bucket.options))


def objects(seed: int, n: int = 5) -> list[tuple[int, bytes, tuple]]:
    leaves = [(1, make_payload(seed * 100 + k, 3000 + 1000 * k), ()) for k in range(n)]
    ids = tuple(object_id(k, r, p) for k, p, r in leaves)
    return [*leaves, (2, make_payload(seed, 64), ids)]


def rank_put(storage, packs, options, objs):
    sink = PackSink(storage, packs, options)
    for kind, payload, refs in objs:
        sink.put(kind, payload, refs, meta=kind == 2)
    return sink, sink.seal()


def test_rank_packs_adopted_and_a_fresh_cache_rebuilds_them(bucket, tmp_path):
    url = bucket.url()
    objs = objects(1)
    with bucket.store(tmp_path / "coord", url, pack_target_size=8 << 10) as store, \
            tempfile.TemporaryDirectory() as staging:
        storage = rank_storage(bucket, store, staging)
        packs = store.reserve_packs(8)
        _, locs = rank_put(storage, packs, store.options, objs)
        assert len({loc.pack for loc in locs}) > 1  # rolled at the target size
        assert {loc.pack for loc in locs} <= set(packs)
        with store.writer() as w:
            w.adopt(locs)
            w.create_root("step/1", w.put(3, b"step", (locs[-1].oid,), meta=True))
        with LocatedReader(storage) as reader:  # the rank reads by location
            for loc, (kind, payload, refs) in zip(locs, objs):
                obj = reader.read(loc)
                assert (obj.kind, obj.payload, obj.refs) == (kind, payload, refs)
        storage.close()
        assert store.verify(deep=True).ok
        want = store.roots()
    with bucket.store(tmp_path / "fresh", url) as fresh:  # only the commit documents
        assert fresh.roots() == want
        for loc, (_, payload, _) in zip(locs, objs):
            assert fresh.get(loc.oid).payload == payload
            assert fresh.locate([loc.oid])[loc.oid] == loc
        assert fresh.verify(deep=True).ok


def test_a_number_claimed_by_another_cache_is_never_written_twice(bucket, tmp_path):
    """The coordinator's reservation is local to its cache; a writer on another cache may
    take a number of the range first. The rank's sink skips it (its claim fails)."""
    url = bucket.url()
    with bucket.store(tmp_path / "a", url) as a, tempfile.TemporaryDirectory() as staging:
        packs = a.reserve_packs(5)
        with bucket.store(tmp_path / "b", url) as b, b.writer() as w:
            w.set_root("other", w.put(1, b"other" * 50))  # b's next pack is packs.start
        other = set(a.storage.sizes())
        assert packs.start in other
        storage = rank_storage(bucket, a, staging)
        _, locs = rank_put(storage, packs, a.options, objects(2, n=2))
        assert packs.start not in {loc.pack for loc in locs}
        with a.writer() as w:
            w.adopt(locs)
            w.create_root("mine", w.put(3, b"top", (locs[-1].oid,), meta=True))
        storage.close()
        assert set(a.roots()) == {"other", "mine"}
        assert a.verify(deep=True).ok


def test_a_rank_meeting_a_gone_pack_is_told_to_look_again(bucket, tmp_path):
    with bucket.store(tmp_path / "a", bucket.url()) as store, \
            tempfile.TemporaryDirectory() as staging:
        storage = rank_storage(bucket, store, staging)
        _, locs = rank_put(storage, store.reserve_packs(4), store.options, objects(3, n=1))
        storage.delete(locs[0].pack)
        with LocatedReader(storage) as reader, pytest.raises(PackMoved):
            reader.read(locs[0])
        storage.close()


def test_unadopted_rank_packs_are_spared_in_grace_then_reclaimed(bucket, tmp_path):
    """No lease reaches another cache: there gc's grace period (counted from the pack's
    upload) spares a put in flight; once it is over, its orphans are reclaimed."""
    url = bucket.url()
    with bucket.store(tmp_path / "a", url) as a, tempfile.TemporaryDirectory() as staging:
        with a.writer() as w:
            w.set_root("kept", w.put(1, b"kept" * 100))
        storage = rank_storage(bucket, a, staging)
        packs = a.reserve_packs(4)
        _, locs = rank_put(storage, packs, a.options, objects(4, n=2))
        rank_packs = {loc.pack for loc in locs}
        slow = {"gc_grace_s": 3600.0}
        with bucket.store(tmp_path / "b", url, storage_options=slow) as b:
            b.gc(threshold=0.0)
        assert rank_packs <= set(a.storage.sizes())  # young: spared
        a.gc(threshold=0.0)  # the same cache: the lease spares them (grace 0 here)
        assert rank_packs <= set(a.storage.sizes())
        a.release_packs(packs)  # the put failed
        with bucket.store(tmp_path / "c", url) as c:  # grace 0: orphans go
            c.gc(threshold=0.0)
            assert not rank_packs & set(c.storage.sizes())
            assert set(c.roots()) == {"kept"} and c.verify(deep=True).ok
        storage.close()


@pytest.mark.parametrize("size", [100, 700_000])
def test_adopt_through_a_bucket_checks_every_header(bucket, tmp_path, size):
    """Headers of small records are fetched in runs (one GET each), large ones one by one:
    a location whose kind, refs or lengths differ from its record is still refused, first,
    middle or last of a run, for small records (one run) and large ones (a GET each)."""
    import dataclasses

    from engine.errors import CorruptObject

    with bucket.store(tmp_path / "a", bucket.url(), pack_target_size=4 << 20) as store, \
            tempfile.TemporaryDirectory() as staging:
        storage = rank_storage(bucket, store, staging)
        objs = [(1, make_payload(k, size), ()) for k in range(5)]
        _, locs = rank_put(storage, store.reserve_packs(4), store.options, objs)
        for i in (0, 2, 4):
            for bad in (dataclasses.replace(locs[i], kind=7),
                        dataclasses.replace(locs[i], raw_len=locs[i].raw_len + 1),
                        dataclasses.replace(locs[i], refs=(locs[0].oid,))):
                w = store.writer()
                with pytest.raises(CorruptObject, match="header"):
                    w.adopt([*locs[:i], bad, *locs[i + 1:]])
                w.abort()
        with store.writer() as w:
            w.adopt(locs)
            w.set_root("ok", w.put(2, b"t", tuple(loc.oid for loc in locs), meta=True))
        assert store.verify(deep=True).ok
        storage.close()


def test_adopt_on_a_bucket_reads_record_headers_in_parallel(moto_s3, tmp_path):
    """Hundreds of records: adopt checks their headers by a few ranged GETs."""
    import time

    with moto_s3.store(tmp_path / "a", moto_s3.url()) as store, \
            tempfile.TemporaryDirectory() as staging:
        storage = PackStorage(attach(store.storage.locator(), staging=staging,
                                     storage_options=moto_s3.options))
        objs = [(1, make_payload(k, 200), ()) for k in range(300)]
        _, locs = rank_put(storage, store.reserve_packs(4), store.options, objs)
        t0 = time.perf_counter()
        with store.writer() as w:
            w.adopt(locs)
            w.set_root("many", w.put(2, b"top", tuple(loc.oid for loc in locs), meta=True))
        took = time.perf_counter() - t0
        storage.close()
        assert store.verify().ok
        print(f"adopt of {len(locs)} records on moto: {took:.2f} s")


@pytest.mark.parametrize("size,most_gets,most_bytes", [(200, 8, 1 << 20),
                                                       (300_000, 20, 64 << 10)])
def test_adopt_on_a_bucket_fetches_headers_not_payloads(moto_s3, tmp_path, monkeypatch,
                                                        size, most_gets, most_bytes):
    """Small records: a few GETs for hundreds of headers. Large ones: a GET each, and
    only header bytes (adoption never downloads what the ranks uploaded)."""
    with moto_s3.store(tmp_path / "a", moto_s3.url(), pack_target_size=8 << 20) as store, \
            tempfile.TemporaryDirectory() as staging:
        storage = PackStorage(attach(store.storage.locator(), staging=staging,
                                     storage_options=moto_s3.options))
        n = 300 if size < 1000 else 12
        objs = [(1, make_payload(k, size), ()) for k in range(n)]
        _, locs = rank_put(storage, store.reserve_packs(4), store.options, objs)
        reads: list[int] = []
        real = store.storage.read

        def counted(pack, offset, length):
            reads.append(length)
            return real(pack, offset, length)

        monkeypatch.setattr(store.storage, "read", counted)
        with store.writer() as w:
            w.adopt(locs)
            w.set_root("r", w.put(2, b"t", tuple(loc.oid for loc in locs), meta=True))
        monkeypatch.undo()
        assert len(reads) <= most_gets + 3, len(reads)  # + footer, trailer, pack header
        assert sum(reads) <= most_bytes + (64 << 10), sum(reads)  # + the trailers
        storage.close()
        assert store.verify(deep=True).ok


def test_a_commit_of_rank_packs_older_than_the_grace_is_refused(bucket, tmp_path):
    """The ranks upload before the coordinator opens its writer: the commit's age counts
    from the oldest adopted pack, not from the writer (a gc elsewhere may already have
    deleted packs that old as a dead writer's)."""
    import time

    # A grace of 3 s: the prompt commit below must finish within 0.9 of it on a loaded
    # 2-core machine (at 1 s it did not, once, in the full suite).
    with bucket.store(tmp_path / "a", bucket.url(),
                      storage_options={"gc_grace_s": 3.0}) as store, \
            tempfile.TemporaryDirectory() as staging:
        storage = rank_storage(bucket, store, staging)
        _, locs = rank_put(storage, store.reserve_packs(4), store.options, objects(5, n=2))
        time.sleep(3.1)
        w = store.writer()  # young writer, old rank packs
        w.adopt(locs)
        w.set_root("late", w.put(3, b"top", (locs[-1].oid,), meta=True))
        with pytest.raises(engine.StoreError, match="gc_grace_s"):
            w.commit()
        assert store.roots() == {}
        _, locs = rank_put(storage, store.reserve_packs(4), store.options, objects(6, n=2))
        with store.writer() as w:  # prompt: commits
            w.adopt(locs)
            w.set_root("prompt", w.put(3, b"top", (locs[-1].oid,), meta=True))
        assert set(store.roots()) == {"prompt"}
        storage.close()

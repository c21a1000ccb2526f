"""Engine items of issue 8 beyond the index damage suite: roots records that grow
linearly, bounded decompression, gc's report of unreadable packs, damaged index bytes
surfacing as StoreError, and read-only opens."""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import stat
import tracemalloc

import lmdb
import pytest
import zstandard
from _helpers import check_dag, find_in_packs, open_store, pack_files, put_dag

import engine
from engine.format import records as fmt
from engine.packs.pack import read_trailer
from engine.store.gc import GCRefused


# -- roots records (item 10) -----------------------------------------------------------
def _roots_record_bytes(path) -> int:
    total = 0
    for p in pack_files(path):
        try:
            entries = read_trailer(p, name=p.name)
        except engine.CorruptObject:
            continue
        total += sum(e.length for e in entries if e.rtype in fmt.ROOTS_RECORDS)
    return total


def test_roots_records_grow_linearly_with_the_number_of_commits(tmp_path):
    # Every commit used to write the full root map: 3,000 steps of a small table took
    # 106 MiB. With deltas, N commits of one new root each cost O(N) bytes.
    n = 400
    totals = {}
    with engine.open(tmp_path / "s") as store:
        for i in range(n):
            with store.writer() as w:
                w.set_root(f"step-{i:08d}", w.put(1, b"x%d" % i))
            if i + 1 in (n // 2, n):
                totals[i + 1] = _roots_record_bytes(tmp_path / "s")
        assert len(store.roots()) == n
    one_full = len(fmt.encode_snapshot(n, {f"step-{i:08d}": bytes(16) for i in range(n)}))
    # A delta record is ~90 bytes; full snapshots come only once the deltas since the last
    # one add up to its size, so they at most double that. Full snapshots every commit
    # would have cost about n * one_full / 2 (~2.5 MB here).
    assert totals[n] < 250 * n, totals
    assert totals[n] < 2.4 * totals[n // 2], totals
    assert totals[n] < one_full * n / 20, (totals, one_full)


def _model_run(store, rnd: random.Random, model: dict, commits: int) -> None:
    for c in range(commits):
        with store.writer() as w:
            for _ in range(rnd.randint(1, 3)):
                if model and rnd.random() < 0.35:
                    name = rnd.choice(sorted(model))
                    w.delete_root(name)
                    del model[name]
                else:
                    name = f"r{rnd.randrange(60)}"
                    model[name] = w.put(1, b"%d-%d" % (c, rnd.randrange(1 << 30)))
                    w.set_root(name, model[name])
        if rnd.random() < 0.1:
            store.gc(threshold=rnd.choice([0.0, 0.25, 1.0]))


@pytest.mark.parametrize("seed", [0, 1] + [pytest.param(s, marks=pytest.mark.slow)
                                      for s in range(2, 6)])
def test_repair_replays_full_snapshots_and_deltas(tmp_path, seed):
    rnd = random.Random(seed)
    model: dict[str, bytes] = {}
    path = tmp_path / "s"
    with engine.open(path, pack_target_size=4096) as store:
        _model_run(store, rnd, model, 120)
        assert store.roots() == model
    shutil.rmtree(path / "index")  # rebuilt from the packs alone on open
    with engine.open(path) as store:
        assert store.roots() == model
        rep = store.repair()
        assert not [p for p in rep.damaged if p.what == "roots-gap"]
        assert store.roots() == model
        _model_run(store, rnd, model, 20)  # the chain goes on after a repair
        store.gc(threshold=0.0)
    shutil.rmtree(path / "index")
    with engine.open(path) as store:
        assert store.roots() == model


# -- bounded decompression (item 9) ----------------------------------------------------
def test_a_decompression_bomb_is_refused_before_its_payload_is_allocated():
    # A crafted record: 64 MiB of zeros in a ~2 KB zstd frame, under a wrong id. Its id
    # check used to run only after the whole payload was allocated.
    raw_len = 64 << 20
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(raw_len))
    head = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, fmt.FORMAT_VERSION, fmt.RECORD_OBJECT, 1,
                                  fmt.CODEC_ZSTD, 0, len(frame), raw_len, b"\x01" * 16)
    import xxhash

    record = head + frame + fmt.CHECKSUM.pack(xxhash.xxh3_64_intdigest(head + frame))
    tracemalloc.start()
    try:
        with pytest.raises(engine.CorruptObject, match="does not match its id"):
            fmt.decode_record(record, 0, pack="crafted")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak} bytes for a {len(record)}-byte record"


def test_genuine_highly_compressible_payloads_still_read_back(tmp_path):
    with engine.open(tmp_path / "s") as store:
        with store.writer() as w:
            oid = w.put(1, bytes(8 << 20))
        assert store.get(oid).payload == bytes(8 << 20)
        assert store.verify(deep=True).ok


def test_records_claiming_more_than_the_largest_payload_are_corrupt():
    head = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, fmt.FORMAT_VERSION, fmt.RECORD_OBJECT, 1,
                                  fmt.CODEC_ZSTD, 0, 1 << 20, fmt.MAX_RAW_LEN + 1, bytes(16))
    with pytest.raises(engine.CorruptObject, match="largest payload"):
        fmt.RecordHeader.unpack(head)


# -- gc reports what it could not read -------------------------------------------------
def test_gc_lists_the_packs_it_could_not_read(tmp_path):
    path = tmp_path / "s"
    with open_store(path, pack_target_size=1 << 20) as store:
        with store.writer() as w:
            put_dag(w, 0, size=20_000, leaves=4)
            put_dag(w, 1, size=20_000, leaves=4)
        with store.writer() as w:
            w.delete_root("r1")
    # Damage a live record of r0 in the data pack that gc is about to rewrite.
    from _helpers import dag

    _, objs = dag(0, size=20_000, leaves=4)
    payload = next(o.payload for o in objs.values() if o.kind == 1 and len(o.payload) > 1000)
    pack, at = find_in_packs(path, payload[16:80])
    with open(pack, "r+b") as f:
        f.seek(at + 8)
        f.write(b"\xff")
    with open_store(path) as store:
        report = store.gc(threshold=0.0)
        assert report.unreadable and report.unreadable[0].pack in str(pack)
        assert pack.exists()  # left in place for verify and repair


# -- damaged index bytes surface as StoreError ----------------------------------------
def _rename_root(path, old: bytes, new: bytes, *, fix_checksum: bool) -> None:
    from engine.index import db as ix

    env = lmdb.open(str(path / "index"), max_dbs=4)
    try:
        db, meta = env.open_db(b"roots"), env.open_db(b"meta")
        with env.begin(write=True) as txn:
            value = txn.get(old, db=db)
            txn.delete(old, db=db)
            txn.put(new, value, db=db)
            if fix_checksum:
                roots = {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
                txn.put(ix.META_ROOTS_SUM, ix.roots_digest(roots), db=meta)
    finally:
        env.close()


def test_damaged_roots_fail_their_checksum_and_are_rebuilt_on_open(tmp_path):
    # A flip in the roots table used to hide roots from gc: it swept their DAGs and wrote
    # a snapshot without them, so not even repair could bring them back.
    path = tmp_path / "s"
    with open_store(path) as store:
        for i in range(3):
            with store.writer() as w:
                put_dag(w, i)
    _rename_root(path, b"r1", b"r7", fix_checksum=False)
    with open_store(path) as store:
        assert store.opened_with_repair is not None
        assert set(store.roots()) == {"r0", "r1", "r2"}
        store.gc(threshold=0.0)
        for i in range(3):
            check_dag(store, i)


def test_a_root_name_that_is_not_utf8_is_a_store_error_everywhere(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as store:
        for i in range(3):
            with store.writer() as w:
                put_dag(w, i)
    # Even damage that passes the roots checksum (here: rewritten with it) is refused.
    _rename_root(path, b"r1", b"r\xff1", fix_checksum=True)
    with open_store(path) as store:
        with pytest.raises(engine.FormatError):
            store.roots()
        report = store.verify()  # reports, never raises
        assert [p.what for p in report.problems] == ["corrupt-root"]
        with pytest.raises(GCRefused):
            store.gc(threshold=0.0)
        store.repair()
        for i in range(3):
            check_dag(store, i)


# -- read-only opens --------------------------------------------------------------------
def _files(path) -> dict[str, tuple[int, int]]:
    """Every file but LMDB's reader table, with (size, mtime_ns)."""
    out = {}
    for p in pathlib.Path(path).rglob("*"):
        if p.is_file() and p.name != "lock.mdb":
            st = p.stat()
            out[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns)
    return out


def _chmod_tree(path, writable: bool) -> None:
    for p in [pathlib.Path(path), *pathlib.Path(path).rglob("*")]:
        mode = p.stat().st_mode
        if writable:
            p.chmod(mode | stat.S_IWUSR)
        else:
            p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_read_only_open_reads_and_writes_nothing(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as store:
        for i in range(3):
            with store.writer() as w:
                put_dag(w, i)
    _chmod_tree(path, writable=False)
    try:
        before = _files(path)
        with engine.open(path, readonly=True) as store:
            for i in range(3):
                check_dag(store, i)
            assert store.verify(deep=True).ok
            assert store.stats().roots == 3
            with pytest.raises(engine.ReadOnly):
                store.writer()
            with pytest.raises(engine.ReadOnly):
                store.gc()
            with pytest.raises(engine.ReadOnly):
                store.repair()
        assert _files(path) == before  # the writer lock file included: never taken
    finally:
        _chmod_tree(path, writable=True)


def test_read_only_open_of_a_missing_store_creates_nothing(tmp_path):
    with pytest.raises(engine.FormatError):
        engine.open(tmp_path / "nothing", readonly=True)
    assert not (tmp_path / "nothing").exists()


def test_read_only_handle_beside_a_writable_one_in_one_process(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as rw:
        with rw.writer() as w:
            put_dag(w, 0)
        with engine.open(path, readonly=True) as ro:
            check_dag(ro, 0)
            with rw.writer() as w:
                put_dag(w, 1)
            check_dag(ro, 1)
    assert os.path.exists(path / "index" / "data.mdb")


def test_an_entry_pointing_past_any_file_is_corrupt_not_overflow(tmp_path):
    # Even an entry that passes its checksum (rewritten with one here) must not let
    # OverflowError escape get().
    from engine.index import db as ix

    path = tmp_path / "s"
    with open_store(path) as store:
        with store.writer() as w:
            oid = w.put(1, b"payload")
            w.set_root("r", oid)
    env = lmdb.open(str(path / "index"), max_dbs=4)
    try:
        db = env.open_db(b"objects")
        with env.begin(write=True) as txn:
            e = ix.ObjectEntry.decode(txn.get(oid, db=db), oid)
            bad = ix.ObjectEntry(e.pack, (1 << 64) - 1, e.length, e.kind, e.raw_len, e.meta,
                                 e.refs)
            txn.put(oid, bad.encode(oid), db=db)
    finally:
        env.close()
    with open_store(path) as store:
        with pytest.raises(engine.CorruptObject):
            store.get(oid)
        assert not store.verify(deep=True).ok

"""The index's meta values written at creation (format version, options) are checksummed,
and an index claiming a version this code cannot read is rebuilt from the packs when every
pack is of a version it reads (docs/FORMAT.md "Format version"). Found by the 4000-seed
flip run (tests/engine/test_index_damage.py): one flipped bit in the version value
(1 -> 17, 1 -> 3) made a healthy store unopenable with "upgrade cnrstore"."""

from __future__ import annotations

import lmdb
import msgpack
import pytest
from _helpers import check_dag, open_store, pack_files, put_dag, run

import engine
from engine.format import records as fmt
from engine.index import db as ix

ROOTS = range(4)


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "store"
    with open_store(path, pack_target_size=64 << 10) as store:
        for i in ROOTS:
            with store.writer() as w:
                put_dag(w, i)
    return path


def _flip_version_bit(path, bit: int) -> int:
    """Flip ``bit`` of the version value where LMDB stores it: the bytes of the node
    right after its key, in every page that holds it. Returns how many were flipped."""
    data = path / "index" / "data.mdb"
    raw = bytearray(data.read_bytes())
    needle = ix.META_VERSION + ix.U64.pack(fmt.FORMAT_VERSION)
    at, flipped = raw.find(needle), 0
    while at >= 0:
        raw[at + len(ix.META_VERSION) + bit // 8] ^= 1 << (bit % 8)
        flipped += 1
        at = raw.find(needle, at + 1)
    data.write_bytes(bytes(raw))
    return flipped


def _meta(path, key: bytes) -> bytes | None:
    env = lmdb.open(str(path / "index"), max_dbs=4, readonly=True, lock=False)
    try:
        db = env.open_db(ix.DB_META, create=False)
        with env.begin() as txn:
            value = txn.get(key, db=db)
            return None if value is None else bytes(value)
    finally:
        env.close()


def _put_meta(path, key: bytes, value: bytes | None) -> None:
    env = lmdb.open(str(path / "index"), max_dbs=4)
    try:
        db = env.open_db(ix.DB_META)
        with env.begin(write=True) as txn:
            if value is None:
                txn.delete(key, db=db)
            else:
                txn.put(key, value, db=db)
    finally:
        env.close()


@pytest.mark.parametrize("bit", [4, 1])  # 1 -> 17 and 1 -> 3, as the flip run found
def test_a_flipped_version_bit_is_rebuilt_from_the_packs(store_path, bit):
    assert _flip_version_bit(store_path, bit) >= 1
    assert _meta(store_path, ix.META_VERSION) == ix.U64.pack(1 ^ (1 << bit))
    with pytest.raises(engine.StaleIndex, match="open the store writable"):
        engine.open(store_path, readonly=True)  # cannot rebuild read-only: says how
    with open_store(store_path) as store:
        report = store.opened_with_repair
        assert report is not None and report.roots_restored == len(ROOTS)
        assert report.damaged[0].what == "damaged-index"
        assert f"format version {1 ^ (1 << bit)}" in report.damaged[0].message
        for i in ROOTS:
            check_dag(store, i)
        assert store.verify(deep=True).ok
    with engine.open(store_path, readonly=True) as store:
        assert set(store.roots()) == {f"r{i}" for i in ROOTS}


def test_the_flip_worker_survives_a_flipped_version(store_path):
    # The flip suite's own worker (open, verify, gc, repair, gc, every root whole).
    _flip_version_bit(store_path, 4)
    rc, lines, err = run("survive", store_path, ",".join(map(str, ROOTS)), timeout=120)
    assert rc == 0 and lines[-1] == "survived", f"rc={rc} {lines} {err[-2000:]}"


@pytest.mark.parametrize("claim", ["version", "damaged-meta"])
def test_a_newer_store_still_says_upgrade_and_is_left_alone(store_path, claim):
    # A newer index, or one this code finds damaged: either way a newer pack means this
    # code must not rebuild it (it would take the newer records for damaged ones).
    if claim == "version":
        _put_meta(store_path, ix.META_VERSION, ix.U64.pack(fmt.FORMAT_VERSION + 1))
    else:
        _put_meta(store_path, ix.META_OPTIONS, msgpack.packb({"compression_level": 9}))
    newest = pack_files(store_path)[-1]
    raw = bytearray(newest.read_bytes())
    raw[4] = fmt.FORMAT_VERSION + 1  # a newer cnrstore's pack header
    newest.write_bytes(bytes(raw))
    files = {p: p.read_bytes() for p in [*pack_files(store_path),
                                         store_path / "index" / "data.mdb"]}
    for readonly in (False, True):
        with pytest.raises(engine.FormatError, match="upgrade cnrstore") as exc:
            engine.open(store_path, readonly=readonly)
        assert not isinstance(exc.value, engine.StaleIndex) or claim != "version"
        assert "has format version 2" in str(exc.value)
    assert {p: p.read_bytes() for p in files} == files  # nothing rebuilt nor written


def test_flipped_options_are_damage_not_tuning(store_path):
    stored = msgpack.unpackb(_meta(store_path, ix.META_OPTIONS))
    assert stored["pack_target_size"] == 64 << 10
    # One flipped bit: still a valid value, which the next open would silently adopt.
    stored["pack_target_size"] ^= 1 << 30
    _put_meta(store_path, ix.META_OPTIONS, msgpack.packb(stored))
    with open_store(store_path) as store:
        report = store.opened_with_repair
        assert report is not None and report.damaged[0].what == "damaged-index"
        assert "checksum" in report.damaged[0].message
        assert store.options.pack_target_size != stored["pack_target_size"]
        for i in ROOTS:
            check_dag(store, i)


def test_an_index_from_before_the_meta_checksum_opens_and_gets_one(store_path):
    _put_meta(store_path, ix.META_META_SUM, None)
    with engine.open(store_path, readonly=True) as store:  # read-only: accepted as is
        check_dag(store, 0)
    assert _meta(store_path, ix.META_META_SUM) is None
    with open_store(store_path) as store:
        assert store.opened_with_repair is None  # nothing was wrong
        assert store.options.pack_target_size == 64 << 10  # the stored options stay
    assert _meta(store_path, ix.META_META_SUM) is not None
    with open_store(store_path) as store:
        assert store.opened_with_repair is None
        check_dag(store, 3)

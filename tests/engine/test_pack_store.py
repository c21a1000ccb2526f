"""Every store against the ObjectStore contract (engine/testing/contract.py), and the pack
store's on-disk behaviour: dedup, codecs, persistence, gc, verify, repair, map growth,
locking."""

from __future__ import annotations

import gc
import os
import pathlib
import random
import subprocess
import sys
import threading

import lmdb
import pytest

import engine
from engine.errors import (
    FormatError,
    StoreClosed,
    StoreError,
    StoreLocked,
)
from engine.format import records as fmt
from engine.format.ids import object_id
from engine.index import db as ix
from engine.packs.pack import list_pack_files
from engine.testing import ObjectStoreContract


def pack_bytes(path) -> int:
    return sum(p.stat().st_size for p in list_pack_files(pathlib.Path(path)).values())


def put_chain(w, n: int, size: int, *, seed: int = 0) -> list[bytes]:
    """n random leaves plus a meta node over them; returns [leaves..., node]."""
    rnd = random.Random(seed)
    leaves = [w.put(1, rnd.randbytes(size)) for _ in range(n)]
    return leaves + [w.put(2, b"node%d" % seed, leaves, meta=True)]


# -- contract: every store (engine/testing/contract.py) --------------------------------------
class TestObjectStoreContract(ObjectStoreContract):
    """Over ``store_factory`` (tests/engine/conftest.py): the memory twin, a directory,
    S3 on moto and a shared directory (and, slow, S3 on SeaweedFS)."""


# -- pack store specifics -------------------------------------------------------------------


def test_dedup_writes_no_bytes(pack_store):
    with pack_store.writer() as w:
        oid = w.put(1, os.urandom(5000))
    data = pack_store.get(oid).payload
    before = pack_bytes(pack_store.path)
    with pack_store.writer() as w:
        w.put(1, data)
    assert pack_bytes(pack_store.path) == before
    assert len(list_pack_files(pack_store.path)) == 1


def test_codec_on_disk(pack_store):
    with pack_store.writer() as w:
        squeezed = w.put(1, b"abcd" * 10_000)
        noise = w.put(1, os.urandom(10_000))
    assert pack_store.info(squeezed).stored_len < 2000
    assert pack_store.info(noise).stored_len > 10_000


def test_compression_level_zero_stores_raw(tmp_path):
    with engine.open(tmp_path / "s", compression_level=0) as store:
        with store.writer() as w:
            oid = w.put(1, b"abcd" * 10_000)
        assert store.info(oid).stored_len > 40_000
        assert store.get(oid).payload == b"abcd" * 10_000


def test_objects_larger_than_a_pack_and_empty_ones(tmp_path):
    with engine.open(tmp_path / "s", pack_target_size=4096) as store:
        big = os.urandom(20_000)
        with store.writer() as w:
            ids = [w.put(1, b""), w.put(1, big), w.put(1, os.urandom(3000)),
                   w.put(1, os.urandom(3000))]
        assert store.get(ids[0]).payload == b"" and store.get(ids[1]).payload == big
        assert len(list_pack_files(store.path)) >= 3  # rolled at the target size
        assert store.verify(deep=True).ok


def test_reopen_persists_everything(tmp_path):
    path = tmp_path / "s"
    with engine.open(path) as store:
        with store.writer() as w:
            ids = put_chain(w, 3, 1000)
            w.set_root("r", ids[-1])
    with engine.open(path, create=False) as store:
        assert store.roots() == {"r": ids[-1]}
        assert store.get(ids[-1]).refs == tuple(ids[:-1])
        assert store.stats().objects == 4


def test_open_validates_arguments_and_layout(tmp_path):
    with pytest.raises(ValueError):
        engine.open(tmp_path / "a", compression_level=99)
    with pytest.raises(ValueError):
        engine.open(tmp_path / "a", pack_target_size=0)
    with pytest.raises(FormatError):
        engine.open(tmp_path / "missing", create=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FormatError, match="not a cnrstore"):
        engine.open(other)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_unknown_format_version_is_refused(tmp_path):
    # Refused when a pack says the store is newer; with only version-1 packs the index's
    # value is damage and is rebuilt (tests/engine/test_index_meta.py).
    path = tmp_path / "s"
    with engine.open(path) as store, store.writer() as w:
        w.set_root("r", w.put(1, b"x"))
    newer = next(iter(list_pack_files(path).values()))
    newer.write_bytes(newer.read_bytes()[:4] + bytes([fmt.FORMAT_VERSION + 1])
                      + newer.read_bytes()[5:])
    env = lmdb.open(str(path / "index"), max_dbs=4)
    meta = env.open_db(ix.DB_META)  # outside the write txn: open_db takes its own
    with env.begin(write=True) as txn:
        txn.put(ix.META_VERSION, ix.U64.pack(fmt.FORMAT_VERSION + 1), db=meta)
    env.close()
    with pytest.raises(FormatError, match="format version 2.*upgrade cnrstore"):
        engine.open(path)


def test_map_grows_past_a_tiny_initial_size(tmp_path):
    path = tmp_path / "s"
    with engine.open(path, map_size=1 << 16) as store:
        with store.writer() as w:
            ids = [w.put(1, b"%d" % i) for i in range(3000)]
        assert store._core.index.map_size > 1 << 16
        assert store.stats().objects == 3000
    with engine.open(path, map_size=1 << 16) as store:
        assert store.get(ids[-1]).payload == b"2999"


def test_concurrent_reads_from_threads(tmp_path):
    pack_store = engine.open(tmp_path / "s", pack_target_size=4096)
    pack_store._core.readers._max = 3  # far fewer descriptors than packs: constant eviction
    with pack_store.writer() as w:
        ids = [w.put(1, os.urandom(3000)) for _ in range(40)]
    assert len(list_pack_files(pack_store.path)) == 40
    expect = {oid: pack_store.get(oid).payload for oid in ids}
    errors = []

    def reader():
        try:
            for oid in ids * 3:
                assert pack_store.get(oid).payload == expect[oid]
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pack_store.close()
    assert errors == []


_HOLD_LOCK = """
import sys, time, engine
s = engine.open(sys.argv[1])
w = s.writer()
print("locked", flush=True)
sys.stdin.readline()
w.abort()
"""


def test_writer_lock_spans_processes(pack_store):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(pack_store.path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=pathlib.Path(engine.__file__).parents[1])
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLocked):
            pack_store.writer(timeout=0.0)
        with pytest.raises(StoreLocked):
            pack_store.gc(timeout=0.1)
        proc.stdin.write("\n")
        proc.stdin.flush()
        pack_store.writer(timeout=20.0).abort()  # waits until the other process lets go
    finally:
        proc.kill()
        proc.wait()


def test_use_after_fork_is_refused(pack_store):
    pid = os.fork()
    if pid == 0:  # child: must get StoreClosed, not a corrupted LMDB handle
        try:
            pack_store.roots()
            os._exit(1)
        except StoreClosed:
            os._exit(0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pack_store.roots() == {}


def test_bad_arguments_raise_before_writing(pack_store):
    with pack_store.writer() as w:
        with pytest.raises(ValueError):
            w.put(256, b"x")
        with pytest.raises(TypeError):
            w.put(1, "text")
        with pytest.raises(ValueError):
            w.put(1, b"x", [b"short"])
        with pytest.raises(ValueError):
            w.set_root("", object_id(1, (), b"x"))
    assert pack_store.stats().objects == 0 and list_pack_files(pack_store.path) == {}
    assert isinstance(StoreLocked("x"), StoreError)


def test_a_transaction_of_many_packs_holds_few_descriptors(tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        with engine.open(tmp_path / "s", pack_target_size=1024) as store:
            with store.writer() as w:
                ids = [w.put(1, os.urandom(1000)) for _ in range(300)]
            assert store.stats().packs == 300
            assert [o.payload for o in store.get_many(ids[::50])]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_puts_from_several_threads_share_one_writer(pack_store):
    payloads = [random.Random(i).randbytes(2000) + bytes(2000) for i in range(60)]
    w = pack_store.writer()
    threads = [threading.Thread(target=lambda part=part: [w.put(1, p) for p in part])
               for part in (payloads[0::3], payloads[1::3], payloads[2::3], payloads[:30])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = w.commit()
    assert (info.objects_new, info.objects_reused) == (60, 30)
    assert pack_store.stats().objects == 60
    for p in payloads:
        assert pack_store.get(object_id(1, (), p)).payload == p
    assert pack_store.verify(deep=True).ok


def test_a_dropped_writer_releases_the_lock(pack_store):
    w = pack_store.writer()
    w.put(1, b"never committed")
    del w
    gc.collect()
    with pack_store.writer(timeout=0.0) as w2:
        w2.put(1, b"next")
    assert pack_store.stats().objects == 1 and len(list_pack_files(pack_store.path)) == 1


def test_a_writer_dropped_inside_a_cycle_releases_the_lock(pack_store):
    w = pack_store.writer()
    w.put(1, b"never committed")
    w.cycle = w  # only the cyclic collector can free it: weakrefs die before __del__
    del w
    gc.collect()
    pack_store.writer(timeout=0.0).abort()


def test_a_failed_append_poisons_the_writer_and_unlocks_on_commit(pack_store):
    import resource
    import signal

    with pack_store.writer() as w:
        w.set_root("r", w.put(1, b"before"))
    packs_before = list_pack_files(pack_store.path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG, not a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, hard))
    try:
        w = pack_store.writer()
        with pytest.raises(StoreError, match="cannot append"):
            w.put(1, os.urandom(64 << 10))  # a real write error: the file size limit
        with pytest.raises(StoreError):
            w.put(1, b"small")  # poisoned: the pack may hold a torn record
        with pytest.raises(StoreError, match="put failed"):
            w.commit()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    pack_store.writer(timeout=0.0).abort()  # the lock was released
    assert pack_store.stats().objects == 1  # nothing of the failed writer is visible
    assert list_pack_files(pack_store.path) == packs_before  # and its pack is gone
    assert pack_store.verify(deep=True).ok


def test_the_memory_twin_unlocks_when_a_writer_is_dropped():
    # The pack store unlocks through a weak reference; the twin used to stay locked forever.
    store = engine.MemoryStore()
    w = store.writer()
    w.put(1, b"never committed")
    del w
    with store.writer() as w2:
        w2.put(1, b"x")

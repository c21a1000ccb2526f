"""engine/index/lmdbcheck.py's walk of the small trees: no healthy file is taken for damage.

A false positive would rebuild a healthy index at every writable open, or refuse a
read-only one, so the walk is run over real LMDB files of every shape the small
databases can take: empty, one leaf, several levels of branches, values on overflow
pages, and the holes that deletes leave.
"""

from __future__ import annotations

import lmdb
from _helpers import open_store, put_dag
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.index import db as ix
from engine.index.lmdbcheck import SMALL_DATABASES, data_file_problem

_NAMES = sorted(SMALL_DATABASES) + [b"objects"]

_entry = st.tuples(st.sampled_from(_NAMES), st.binary(min_size=1, max_size=120),
                   st.integers(0, 9000))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.lists(_entry, max_size=400), bulk=st.integers(0, 3000),
       drop=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_healthy_files_pass_the_walk(tmp_path_factory, entries, bulk, drop, seed):
    path = tmp_path_factory.mktemp("lmdb")
    env = lmdb.open(str(path), max_dbs=8, map_size=1 << 28)
    try:
        dbs = {name: env.open_db(name) for name in _NAMES}
        with env.begin(write=True) as txn:
            for name, key, size in entries:
                txn.put(key, bytes([seed % 251]) * size, db=dbs[name])
            # Enough keys in one small database for branch pages over several levels.
            for i in range(bulk):
                txn.put(b"k%08d" % (i * 7919 % 100003), b"v" * (i % 50), db=dbs[b"roots"])
        if drop:
            with env.begin(write=True) as txn:
                for i, (key, _) in enumerate(txn.cursor(db=dbs[b"roots"])):
                    if i % (drop + 1) == 0:
                        txn.delete(key, db=dbs[b"roots"])
    finally:
        env.close()
    assert data_file_problem(path / "data.mdb") is None


def test_a_real_store_index_passes_the_walk(tmp_path):
    # Many roots and packs: the roots and packs trees grow branch pages.
    with open_store(tmp_path / "s", pack_target_size=16 << 10) as store:
        for i in range(300):
            with store.writer() as w:
                put_dag(w, i)
            if i % 100 == 99:
                with store.writer() as w:
                    for j in range(i - 50, i):
                        w.delete_root(f"r{j}")
                store.gc(threshold=0.0)
    assert ix.data_file_problem(tmp_path / "s" / "index" / "data.mdb") is None


def test_a_node_past_its_page_is_found(tmp_path):
    env = lmdb.open(str(tmp_path), max_dbs=8)
    try:
        roots = env.open_db(b"roots")
        with env.begin(write=True) as txn:
            txn.put(b"r0", b"x" * 16, db=roots)
    finally:
        env.close()
    data = tmp_path / "data.mdb"
    assert data_file_problem(data) is None
    raw = bytearray(data.read_bytes())
    psize = int.from_bytes(raw[40:44], "little")
    last = max(int.from_bytes(raw[n * psize + 136 : n * psize + 144], "little") for n in (0, 1))
    candidates = [p for p in range(2, last + 1)
                  if int.from_bytes(raw[p * psize : p * psize + 8], "little") == p]
    assert candidates
    for p in candidates:  # every tree page of the file gets a pointer past its end
        raw[p * psize + 16 : p * psize + 18] = (0xFFF0).to_bytes(2, "little")
    data.write_bytes(bytes(raw))
    assert "outside the page" in (data_file_problem(data) or "")

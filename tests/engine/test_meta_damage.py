"""The index's meta values that carry no checksum (every commit moves them) must never
lead a maintenance command to lose a root or leave the store unwritable.

gc keeps only the roots records of the chain the index names (``meta.roots_chain``), a
value without a checksum: it must trust that value only when the chain's records replay
to the index's roots (engine/store/rootschain.py).

Found by CI (test_index_damage.py::test_random_flips_in_data_mdb, seed 11): a flipped bit
made the chain name a pack that does not exist. gc then merged the small meta packs
without their roots records, verify still passed (the index's roots were intact), and
the repair after it, which reads roots from the packs alone, found none: every root
dropped, and the next gc swept their objects.
"""

from __future__ import annotations

import shutil

import lmdb
import pytest
from _helpers import check_dag, open_store, put_dag
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.index import db as ix

ROOTS = list(range(6))


def _make(path) -> None:
    """r0..r5, with a gc between (so the chain is a fresh snapshot and deltas after it)
    and small meta packs that the next gc merges."""
    with open_store(path, pack_target_size=64 << 10) as store:
        for i in ROOTS:
            with store.writer() as w:
                put_dag(w, i)
            if i == 2:
                with store.writer() as w:
                    put_dag(w, 99)
                with store.writer() as w:
                    w.delete_root("r99")
                store.gc(threshold=0.0)


def _meta(path) -> tuple[list[int], int, int, list[int]]:
    env = lmdb.open(str(path / "index"), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            meta, packs = env.open_db(ix.DB_META, txn=txn), env.open_db(ix.DB_PACKS, txn=txn)
            chain, _, _ = ix.get_chain(txn, meta)
            listed = [ix.unpack_pack_key(k) for k, _ in txn.cursor(db=packs)]
            return chain, ix.get_u64(txn, meta, ix.META_SEQ), len(listed), listed
    finally:
        env.close()


def _set_meta(path, **values: bytes) -> None:
    env = lmdb.open(str(path / "index"), max_dbs=4)
    try:
        with env.begin(write=True) as txn:
            meta = env.open_db(ix.DB_META, txn=txn)
            for key, value in values.items():
                txn.put(getattr(ix, key), value, db=meta)
    finally:
        env.close()


def _gc_repair_gc(path) -> None:
    with open_store(path) as store:
        store.gc(threshold=0.0)
        store.repair()
        store.gc(threshold=0.0)
        assert set(store.roots()) == {f"r{i}" for i in ROOTS}
        for i in ROOTS:
            check_dag(store, i)
        report = store.verify(deep=True)
        assert report.ok, report.problems
    with open_store(path) as store:  # and a repair from the packs alone finds them too
        store.repair()
        assert set(store.roots()) == {f"r{i}" for i in ROOTS}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("chain") / "store"
    _make(path)
    return path


def test_a_chain_naming_a_pack_that_is_not_there_loses_no_root(template, tmp_path):
    path = tmp_path / "store"
    shutil.copytree(template, path)
    chain, _, _, listed = _meta(path)
    _set_meta(path, META_CHAIN=ix.chain_value([max(listed) + 1000], 0, 100))
    _gc_repair_gc(path)
    assert _meta(path)[0] != [max(listed) + 1000]


def test_a_healthy_gc_keeps_the_chain_rather_than_writing_a_snapshot(template, tmp_path):
    # A fresh snapshot takes a higher sequence, which a gc killed before its commit would
    # leave looking like a lost commit (test_pack_merge.py): a sound chain is copied.
    path = tmp_path / "store"
    shutil.copytree(template, path)
    with open_store(path, pack_target_size=64 << 10) as store:
        for i in range(3):
            with store.writer() as w:
                put_dag(w, 200 + i)
    _, seq, npacks, _ = _meta(path)
    with open_store(path, pack_target_size=64 << 10) as store:
        store.gc(threshold=0.0)
    chain, after, merged, _ = _meta(path)
    assert merged < npacks  # the small packs were merged, chain records and all
    assert after == seq and chain


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damaged_chain_or_sequence_loses_no_root(template, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("damaged") / "store"
    shutil.copytree(template, path)
    chain, seq, _, listed = _meta(path)
    choices = sorted(set(listed) | {max(listed) + 1, max(listed) + 77, 2**31})
    bad = data.draw(st.lists(st.sampled_from(choices), max_size=5), label="chain")
    values = {"META_CHAIN": ix.chain_value(bad, data.draw(st.integers(0, 1 << 20)),
                                           data.draw(st.integers(0, 1 << 20)))}
    if data.draw(st.booleans(), label="damage the sequence too"):
        values["META_SEQ"] = ix.U64.pack(data.draw(st.sampled_from([0, 1, seq - 1, seq + 5])))
    _set_meta(path, **values)
    _gc_repair_gc(path)


@pytest.mark.parametrize("value", [1 << 32 | 5, 1 << 40, 1 << 63])
def test_a_next_pack_past_the_pack_numbers_is_rebuilt_not_kept(template, tmp_path, value):
    # The writer's and gc's freshness check treats a damaged index as behind its packs
    # and rebuilds it from them; the rebuild must not keep the damaged value.
    path = tmp_path / "store"
    shutil.copytree(template, path)
    _set_meta(path, META_NEXT_PACK=ix.U64.pack(value))
    with open_store(path) as store:
        with store.writer() as w:
            put_dag(w, 7)
        store.gc(threshold=0.0)
        store.repair()
        with store.writer() as w:
            put_dag(w, 8)
        for i in [*ROOTS, 7, 8]:
            check_dag(store, i)
    assert max(_meta(path)[3]) < 1000

"""gc merges small packs (docs/FORMAT.md "Garbage collection", issue 23 item 16): every
commit writes its own fresh packs (a data pack and a meta pack), so many tiny commits left
thousands of files each rounded up to a disk block; gc now rewrites the small packs of
each kind together, through the same crash-safe compaction that rewrites dead packs."""

from __future__ import annotations

import random
import signal

import pytest
from _helpers import check_dag, open_store, pack_bytes, pack_files, put_dag, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine.fs.crashpoints import POINTS
from engine.index import db as ix
from engine.store.gcplan import SMALL_PACK_DIVISOR

TARGET = 64 << 10
LIMIT = TARGET // SMALL_PACK_DIVISOR


def _listed(store) -> dict[int, ix.PackEntry]:
    index = store._core.index
    return index.read(lambda txn: {ix.unpack_pack_key(k): ix.PackEntry.decode(v)
                                   for k, v in txn.cursor(db=index.packs)})


def _tiny_commits(store, n: int, seed: int = 0, start: int = 0
                  ) -> dict[str, tuple[bytes, bytes]]:
    """``n`` commits, each one small leaf, a meta node over it and a root."""
    rnd = random.Random(seed)
    kept = {}
    for i in range(start, start + n):
        with store.writer() as w:
            payload = rnd.randbytes(rnd.randrange(1, 300))
            leaf = w.put(1, payload)
            node = w.put(2, b"node %d" % i, [leaf], meta=True)
            w.set_root(f"s{i}", node)
        kept[f"s{i}"] = (node, payload)
    return kept


def _intact(store, kept: dict[str, tuple[bytes, bytes]]) -> None:
    assert store.roots() == {name: node for name, (node, _) in kept.items()}
    for node, payload in kept.values():
        top = store.get(node)
        assert store.get(top.refs[0]).payload == payload
    report = store.verify(deep=True)
    assert report.ok, report.problems


def test_gc_merges_the_packs_of_many_tiny_commits(store_factory):
    kind = store_factory.kind
    if kind == "memory":
        pytest.skip("the memory twin keeps no packs")
    opts = {} if kind == "pack" else {"storage_options": {"gc_grace_s": 0.0}}
    store = store_factory(pack_target_size=TARGET, **opts)
    n = 150 if kind == "pack" else 40
    kept = _tiny_commits(store, n)
    assert len(store._core.storage.sizes()) == 2 * n  # a data and a meta pack each
    report = store.gc()
    assert report.objects_freed == 0 and report.packs_rewritten == 2 * n
    listed = _listed(store)
    # Everything of 150 commits (about 35 KB) fits one data and one meta pack.
    assert len(listed) <= 2, listed
    assert set(store._core.storage.sizes()) == set(listed)
    _intact(store, kept)
    again = store.gc()
    assert (again.packs_rewritten, again.packs_deleted) == (0, 0)
    _intact(store, kept)


def test_tiny_commits_after_gc_take_a_handful_of_files(tmp_path):
    path = tmp_path / "s"
    with open_store(path) as store:  # default pack_target_size (256 MiB)
        kept = _tiny_commits(store, 120, seed=1)
        before = (len(pack_files(path)), pack_bytes(path))
        store.gc()
        after = (len(pack_files(path)), pack_bytes(path))
        assert before[0] == 240 and after[0] <= 2, (before, after)
        assert after[1] * 10 < before[1], (before, after)  # 4 KiB blocks per file are gone
        _intact(store, kept)
        kept |= _tiny_commits(store, 30, seed=2, start=120)  # the merged packs grow
        store.gc()
        assert len(pack_files(path)) <= 2
        _intact(store, kept)


def test_a_lone_small_pack_is_left_alone(pack_store):
    with pack_store.writer() as w:
        w.set_root("a", w.put(1, b"a" * 100))  # one data pack, one meta pack (roots)
    report = pack_store.gc()
    assert report.packs_rewritten == 0  # copying a lone pack to another gains nothing


def test_large_packs_are_not_merged(tmp_path):
    with open_store(tmp_path / "s", pack_target_size=TARGET) as store:
        for i in range(4):
            with store.writer() as w:
                put_dag(w, i, size=LIMIT, leaves=3, root=True)
        sizes = {n: p.size for n, p in _listed(store).items() if not p.meta}
        assert all(s >= LIMIT for s in sizes.values())
        store.gc()
        assert {n: p.size for n, p in _listed(store).items() if not p.meta} == sizes
        for i in range(4):
            check_dag(store, i, size=LIMIT)


GC_POINTS = [p for p in POINTS if p.startswith("gc.")]


@pytest.mark.parametrize("point", GC_POINTS)
def test_merging_gc_killed_at_point(tmp_path, point):
    """A merge is a compaction: killed anywhere, every root reads back and the next gc
    finishes the merge."""
    path = tmp_path / "s"
    with open_store(path) as store:
        kept = _tiny_commits(store, 30)
        with store.writer() as w:
            dropped = store.get(store.root("s7"))
            w.delete_root("s7")
        del kept["s7"]
    rc, _, err = run("gc", path, 0.25, env={"CNRSTORE_CRASH_AT": point})
    assert rc == -signal.SIGKILL, f"gc did not reach {point}: rc={rc} {err}"
    with open_store(path) as store:
        # The merge copies the roots chain instead of writing a newer snapshot, so its
        # sealed packs never look like a lost commit: no rebuild, which would bring the
        # swept objects back from the old packs.
        assert store.opened_with_repair is None
        if point != "gc.after_mark":
            assert not store.has(dropped.refs[0])
        _intact(store, kept)
        store.gc()
        assert len(pack_files(path)) <= 2
        _intact(store, kept)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["tiny", "big", "drop", "gc"]),
                              st.integers(0, 2**31)), min_size=1, max_size=25))
def test_merging_never_loses_data_and_settles(tmp_path_factory, ops):
    """Any mix of tiny and large commits, root drops and gcs: every kept root reads back,
    and two gcs in a row leave at most one small pack of each kind, which a third leaves
    alone (merging converges; it never rewrites the same packs forever)."""
    path = tmp_path_factory.mktemp("merge") / "s"
    kept: dict[str, tuple[bytes, bytes]] = {}
    with engine.open(path, pack_target_size=TARGET) as store:
        for i, (op, seed) in enumerate(ops):
            rnd = random.Random(seed)
            if op == "drop" and kept:
                name = rnd.choice(sorted(kept))
                with store.writer() as w:
                    w.delete_root(name)
                del kept[name]
            elif op == "gc":
                store.gc(threshold=rnd.choice([0.0, 0.25, 1.0]))
            elif op in ("tiny", "big"):
                size = rnd.randrange(1, 200) if op == "tiny" else rnd.randrange(LIMIT, TARGET)
                payload = rnd.randbytes(size)
                with store.writer() as w:
                    leaf = w.put(1, payload)
                    node = w.put(2, b"n%d" % i, [leaf], meta=True)
                    w.set_root(f"s{i}", node)
                kept[f"s{i}"] = (node, payload)
        store.gc()
        store.gc()
        small = [p.meta for p in _listed(store).values() if p.size < LIMIT]
        assert small.count(True) <= 1 and small.count(False) <= 1, _listed(store)
        assert store.gc().packs_rewritten == 0
        _intact(store, kept)

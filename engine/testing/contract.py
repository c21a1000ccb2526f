"""The contract every ``ObjectStore`` keeps (engine/api.py), as a test class a store or a
storage backend runs on itself, as zarr ships ``zarr.testing``: subclass it in a test
module (a name starting with ``Test``) and give it a ``store_factory`` fixture::

    import pytest
    from engine.testing import ObjectStoreContract

    class TestMyBackend(ObjectStoreContract):
        @pytest.fixture
        def store_factory(self, tmp_path):
            made = []

            def make(**options):  # options as for engine.open; a backend may ignore them
                made.append(engine.storage_open(..., cache_dir=tmp_path / f"c{len(made)}",
                                                **options))
                return made[-1]

            yield make
            for store in made:
                store.close()

tests/engine/test_pack_store.py runs it over the memory twin, a directory, a shared
directory and S3 (moto). Needs pytest and hypothesis (the test extra).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..api import ObjectStore
from ..errors import ObjectNotFound, RootExists, StoreClosed, StoreLocked
from ..format.ids import object_id

# A fresh store per call; keyword options as for ``engine.open`` (a backend may ignore
# them). The fixture closes every store it made at teardown.
StoreFactory = Callable[..., ObjectStore]

# Sizes from 0 past the 4 KiB pack target used below; random (stored raw) or repetitive
# (stored zstd).
PAYLOADS = st.one_of(
    st.binary(max_size=64),
    st.tuples(st.integers(0, 9000), st.integers(0, 2**32)).map(
        lambda t: random.Random(t[1]).randbytes(t[0])),
    st.tuples(st.integers(0, 9000), st.binary(min_size=1, max_size=8)).map(
        lambda t: (t[1] * t[0])[: t[0]]),
)


class ObjectStoreContract:
    """What any store must do, whatever holds its bytes: round trips, dedup, refs and
    roots checked, one writer at a time, nothing of an aborted or refused put visible,
    and the same refusals as the pack store."""

    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(objs=st.lists(st.tuples(st.integers(0, 255), PAYLOADS, st.booleans()),
                         min_size=1, max_size=6), nref=st.integers(0, 3))
    def test_round_trip(self, store_factory: StoreFactory, objs: list[tuple[int, bytes, bool]],
                        nref: int) -> None:
        # One store per test run, shared by the examples: they must not disturb each other.
        if not hasattr(store_factory, "shared"):
            store_factory.shared = store_factory(pack_target_size=4096)  # type: ignore[attr-defined]
        store: ObjectStore = store_factory.shared  # type: ignore[attr-defined]
        written: dict[bytes, tuple[int, tuple[bytes, ...], bytes]] = {}
        with store.writer() as w:
            for kind, payload, meta in objs:
                refs = tuple(list(written)[-nref:]) if nref else ()
                oid = w.put(kind, payload, refs, meta=meta)
                assert oid == object_id(kind, refs, payload)
                written[oid] = (kind, refs, payload)
        for oid, (kind, refs, payload) in written.items():
            obj = store.get(oid)
            assert (obj.kind, obj.refs, obj.payload) == (kind, refs, payload)
            info = store.info(oid)
            assert (info.kind, info.refs, info.raw_len) == (kind, refs, len(payload))
        assert [o.payload for o in store.get_many(list(written))] == [
            v[2] for v in written.values()
        ]


    def test_dedup_counts_reuse(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        with store.writer() as w:
            a = w.put(1, b"same")
            assert w.put(1, b"same") == a
        w2 = store.writer()
        assert w2.put(1, b"same") == a
        info = w2.commit()
        assert (info.objects_new, info.objects_reused, info.bytes_written) == (0, 1, 0)


    def test_refs_must_exist(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        with store.writer() as w, pytest.raises(ObjectNotFound):
            w.put(1, b"x", [b"\x01" * 16])
        with store.writer() as w:
            a = w.put(1, b"a")
            b = w.put(1, b"b", [a])  # a ref put earlier in the same writer is fine
        assert store.get(b).refs == (a,)


    def test_a_writer_says_which_objects_it_lacks(self, store_factory: StoreFactory) -> None:
        # ``missing``: what ``has`` says of each, committed and put in this writer alike
        store = store_factory()
        with store.writer() as w:
            a = w.put(1, b"a")
        with store.writer() as w:
            b = w.put(1, b"b")
            absent = b"\x01" * 16
            assert w.missing([a, b, absent]) == {absent}
            assert w.missing([]) == set()
            assert all(w.has(o) == (o not in w.missing([o])) for o in (a, b, absent))

    def test_roots_set_move_delete(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        with store.writer() as w:
            a, b = w.put(1, b"a"), w.put(1, b"b")
            w.set_root("one", a)
            w.set_root("two", a)
        with store.writer() as w:
            w.set_root("two", b)
            w.delete_root("one")
            with pytest.raises(ObjectNotFound):
                w.delete_root("never")
            with pytest.raises(ObjectNotFound):
                w.set_root("bad", b"\x07" * 16)
        assert store.roots() == {"two": b}
        assert store.root("one") is None and store.root("two") == b


    def test_abort_publishes_nothing(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        with pytest.raises(RuntimeError), store.writer() as w:
            oid = w.put(1, b"lost")
            w.set_root("r", oid)
            raise RuntimeError("boom")
        assert not store.has(oid) and store.roots() == {}
        with pytest.raises(ObjectNotFound):
            store.get(oid)


    def test_second_writer_is_locked_out(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        w = store.writer()
        with pytest.raises(StoreLocked):
            store.writer(timeout=0.0)
        with pytest.raises(StoreLocked):
            store.writer(timeout=0.05)
        w.abort()
        store.writer().abort()  # free again


    def test_closed_store_refuses_use(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        store.close()
        with pytest.raises(StoreClosed):
            store.roots()


    def test_finished_writer_refuses_more_work(self, store_factory: StoreFactory) -> None:
        store = store_factory()
        w = store.writer()
        w.put(1, b"a")
        w.commit()
        with pytest.raises(StoreClosed):
            w.put(1, b"b")
        with pytest.raises(StoreClosed):
            w.commit()
        w.abort()  # harmless after commit
        store.writer().abort()  # the lock was released


    def test_both_stores_refuse_an_empty_or_unencodable_root_name(self, store_factory: StoreFactory
                                                                  ) -> None:
        store = store_factory()
        with store.writer() as w:
            oid = w.put(1, b"x")
            for bad in ("", "\udc80", "x" * 600):
                with pytest.raises(ValueError):
                    w.set_root(bad, oid)
                with pytest.raises(ValueError):
                    w.create_root(bad, oid)
        assert store.roots() == {}


    def test_create_root_fails_at_commit_with_nothing_published(self, store_factory: StoreFactory
                                                                ) -> None:
        store = store_factory()
        with store.writer() as w:
            first = w.put(1, b"first")
            w.create_root("a", first)
        w = store.writer()
        second = w.put(1, b"second")
        w.create_root("b", second)
        w.delete_root("a")
        w.create_root("a", second)  # deleted then created in one writer: allowed
        w.commit()
        assert store.roots() == {"a": second, "b": second}
        with pytest.raises(RootExists):
            with store.writer() as w:
                w.create_root("a", second)
        assert store.root("a") == second


    @pytest.mark.parametrize("kind, payload, refs, error", [
        (True, b"x", (), ValueError),              # a bool is not a kind
        (256, b"x", (), ValueError),               # kinds are one byte
        (1, [1, 2, 3], (), TypeError),             # a list of ints is not bytes-like
        (1, "text", (), TypeError),
        (1, b"x", b"\x00" * 16, TypeError),        # one id where a sequence of ids belongs
    ])
    def test_every_store_refuses_what_the_pack_store_refuses(
            self, store_factory: StoreFactory, kind: Any, payload: Any, refs: Any,
            error: type[Exception]) -> None:
        # The twin is the tests' oracle: it must refuse exactly the puts the pack store
        # refuses, before anything is written (it accepted a bool kind and a list payload).
        store = store_factory()
        with store.writer() as w:
            with pytest.raises(error):
                w.put(kind, payload, refs)
            w.set_root("ok", w.put(1, b"fine"))
        assert store.roots() == {"ok": object_id(1, [], b"fine")}
        assert store.stats().objects == 1

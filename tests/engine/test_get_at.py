"""``get_at`` / ``get_into_at``: reads at locations ``locate_closure`` found in one read
transaction (a restore's batched lookups) give what ``get`` / ``get_into`` give, with the
same checks; a stale location (its pack gone, as after a gc) is looked up again."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _helpers import open_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import CorruptObject
from engine.format.location import RecordLocation
from engine.store.memory import MemoryStore

KIND = 7


def _payload(n: int, seed: int, zeros: bool) -> bytes:
    if zeros:  # compressible: stored zstd, so get_into_at falls back to a read
        return bytes(n)
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.tuples(st.integers(0, 70_000), st.booleans()), min_size=1,
                      max_size=6),
       prefix=st.integers(0, 16), seed=st.integers(0, 99))
def test_located_reads_match_plain_reads(tmp_path_factory, specs, prefix, seed):
    with open_store(tmp_path_factory.mktemp("s") / "store") as store:
        with store.writer() as w:
            oid = None
            for i, (size, zeros) in enumerate(specs):  # a chain, as a block's patches
                refs = (oid,) if oid is not None else ()
                oid = w.put(KIND, _payload(prefix + size, seed + i, zeros), refs)
        assert oid is not None
        locs = store.locate_closure([oid])
        assert len(locs) == len({loc.oid for loc in locs.values()})
        for o, loc in locs.items():
            assert store.get_at(loc) == store.get(o)
            size = len(store.get(o).payload) - prefix
            if size < 0:
                continue
            a, b = bytearray(size), bytearray(size)
            got = store.get_into_at(loc, KIND, prefix, memoryview(a), fallback=True)
            want = store.get_into(o, KIND, prefix, memoryview(b), fallback=True)
            assert got == want
            if isinstance(want, bytes):
                assert a == b == bytearray(store.get(o).payload[prefix:])


def test_stale_location_is_looked_up_again(tmp_path):
    with open_store(tmp_path / "store") as store:
        with store.writer() as w:
            oid = w.put(KIND, _payload(5000, 1, False))
        loc = store.locate([oid])[oid]
        gone = dataclasses.replace(loc, pack=loc.pack + 1000)  # a pack a gc removed
        assert store.get_at(gone) == store.get(oid)
        out = bytearray(5000)
        assert store.get_into_at(gone, KIND, 0, memoryview(out)) == b""
        assert bytes(out) == store.get(oid).payload


def test_location_of_another_record_is_corrupt(tmp_path):
    with open_store(tmp_path / "store") as store:
        with store.writer() as w:
            a = w.put(KIND, _payload(3000, 1, False))
            b = w.put(KIND, _payload(3000, 2, False))
        locs = store.locate([a, b])
        wrong = dataclasses.replace(locs[b], oid=a)  # b's record under a's id
        with pytest.raises(CorruptObject):
            store.get_at(wrong)
        with pytest.raises(CorruptObject):
            store.get_into_at(wrong, KIND, 0, memoryview(bytearray(3000)))


def test_memory_twin_reads_by_id():
    twin = MemoryStore()
    with twin.writer() as w:
        oid = w.put(KIND, b"abc")
    loc = RecordLocation(oid, KIND, (), 0, 0, 0, 3, False)  # the twin has no packs
    assert twin.get_at(loc).payload == b"abc"
    assert twin.get_into_at(loc, KIND, 1, memoryview(bytearray(2))) is None
    twin.prefetch_at([loc])  # a hint: nothing to do

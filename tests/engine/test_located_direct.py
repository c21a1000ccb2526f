"""A rank's reads by location take the store's direct path: ``LocatedObjects.get_into``
lands a raw record in the caller's memory with the store's checks, ``locate_closure`` and
``prefetch`` work from the locations the coordinator sent. Before, a rank's ``get_into``
returned None (every block was read into a fresh buffer and copied) and its read-ahead
hints did nothing: a cold restore on a rank took twice the coordinator's time."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import open_store

from engine import LocatedObjects, LocatedReader
from engine.errors import CorruptObject, PackMoved

KIND = 7


def _noise(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _store(path):
    store = open_store(path)
    with store.writer() as w:
        raw = w.put(KIND, _noise(100_000, 1))
        packed = w.put(KIND, bytes(100_000))  # zeros: compressed
        top = w.put(KIND + 1, _noise(1000, 2), (raw, packed))
        w.set_root("r", top)
    return store, raw, packed, top


def test_get_into_reads_a_raw_record_directly_and_declines_the_rest(tmp_path):
    store, raw, packed, top = _store(tmp_path / "s")
    with store, LocatedReader(tmp_path / "s") as reader:
        view = LocatedObjects(reader, store.locate_closure([top]))
        out = bytearray(99_990)
        head = view.get_into(raw, KIND, 10, memoryview(out))
        assert head == store.get(raw).payload[:10]
        assert bytes(out) == store.get(raw).payload[10:]
        blank = bytearray(b"\xaa" * 99_990)
        assert view.get_into(packed, KIND, 10, memoryview(blank)) is None   # compressed
        assert view.get_into(raw, KIND + 1, 10, memoryview(blank)) is None  # kind
        assert bytes(blank) == b"\xaa" * 99_990
        assert view.get_into(packed, KIND, 10, memoryview(blank), fallback=True) == \
            store.get(packed)
        # the block reads of a restore locate a chain, then read at its locations
        assert view.locate_closure([top]) == store.locate_closure([top])
        assert view.locate_closure([raw]) == {raw: store.locate([raw])[raw]}
        assert view.locate([b"\0" * 16]) == {}
        loc = view.locate_closure([raw])[raw]
        again = bytearray(99_990)
        assert view.get_into_at(loc, KIND, 10, memoryview(again)) == head
        assert again == out
        view.prefetch([top, b"\0" * 16])  # a hint: never raises for ids it lacks
        view.prefetch_at([loc])


def test_a_flipped_byte_in_a_raw_record_is_caught(tmp_path):
    store, raw, _, top = _store(tmp_path / "s")
    locs = store.locate_closure([top])
    payload = store.get(raw).payload
    store.close()
    for p in (tmp_path / "s" / "packs").rglob("*.pack"):
        data = bytearray(p.read_bytes())
        at = data.find(payload[5000:5032])
        if at >= 0:
            data[at + 7] ^= 1
            p.write_bytes(bytes(data))
    with LocatedReader(tmp_path / "s") as reader:
        view = LocatedObjects(reader, locs)
        for id_check in (True, False):
            with pytest.raises(CorruptObject):
                view.get_into(raw, KIND, 0, memoryview(bytearray(len(payload))),
                              id_check=id_check)


def test_a_moved_pack_is_reported_as_moved(tmp_path):
    store, raw, _, top = _store(tmp_path / "s")
    with store:
        locs = store.locate_closure([top])
        with store.writer() as w:
            w.delete_root("r")
            w.set_root("k", raw)
        store.gc(threshold=0.0)  # rewrites the pack: raw moves
        with LocatedReader(tmp_path / "s") as reader:
            view = LocatedObjects(reader, locs)
            with pytest.raises(PackMoved):
                view.get_into(raw, KIND, 0, memoryview(bytearray(100_000)))
            fresh = LocatedObjects(reader, store.locate([raw]))
            out = bytearray(100_000)
            assert fresh.get_into(raw, KIND, 0, memoryview(out)) == b""
            assert bytes(out) == store.get(raw).payload

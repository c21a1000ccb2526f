"""``get_into``: a raw record's payload read straight into the caller's memory, with the
same checks as ``get`` (checksum always, id unless asked not to), and None wherever the
direct read does not apply (compressed, another kind or size, the memory twin)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _helpers import open_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine.errors import CorruptObject
from engine.store.memory import MemoryStore

KIND = 7


def _noise(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=st.integers(0, 40), size=st.integers(0, 300_000), seed=st.integers(0, 9))
def test_raw_payload_lands_in_out(tmp_path_factory, prefix, size, seed):
    payload = _noise(prefix + size, seed)
    with open_store(tmp_path_factory.mktemp("s") / "store") as store:
        with store.writer() as w:
            oid = w.put(KIND, payload)
        out = bytearray(size)
        head = store.get_into(oid, KIND, prefix, memoryview(out))
        if store.info(oid).stored_len != store.info(oid).raw_len + 52:  # zstd
            return
        assert head == payload[:prefix]
        assert bytes(out) == payload[prefix:] == store.get(oid).payload[prefix:]


def test_not_applicable_returns_none_and_leaves_out_alone(tmp_path):
    with open_store(tmp_path / "store") as store:
        with store.writer() as w:
            raw = w.put(KIND, _noise(100_000, 1))
            packed = w.put(KIND, bytes(100_000))  # zeros: compressed
            refd = w.put(KIND + 1, _noise(1000, 2), (raw,))
        out = bytearray(b"\xaa" * 99_990)
        assert store.get_into(packed, KIND, 10, memoryview(out)) is None
        assert store.get_into(raw, KIND + 1, 10, memoryview(out)) is None      # kind
        assert store.get_into(raw, KIND, 11, memoryview(out)) is None          # size
        assert bytes(out) == b"\xaa" * 99_990
        small = bytearray(990)
        assert store.get_into(refd, KIND + 1, 10, memoryview(small)) is not None
        assert bytes(small) == store.get(refd).payload[10:]
    twin = MemoryStore()
    with twin.writer() as w:
        oid = w.put(KIND, b"abc")
    assert twin.get_into(oid, KIND, 1, memoryview(bytearray(2))) is None
    assert twin.get_into(oid, KIND, 1, memoryview(bytearray(2)), fallback=True).payload == b"abc"


def test_fallback_returns_the_object_read_as_get_reads_it(tmp_path):
    with open_store(tmp_path / "store") as store:
        with store.writer() as w:
            raw = w.put(KIND, _noise(100_000, 1))
            packed = w.put(KIND, bytes(100_000))
        out = bytearray(99_990)
        assert store.get_into(packed, KIND, 10, memoryview(out), fallback=True) == \
            store.get(packed)
        assert store.get_into(raw, KIND + 1, 10, memoryview(out), fallback=True) == \
            store.get(raw)
        assert store.get_into(raw, KIND, 10, memoryview(out), fallback=True) == \
            store.get(raw).payload[:10]


def _flip_in_record(root, needle: bytes, delta: int) -> None:
    """Flip one bit ``delta`` bytes after ``needle`` in the pack that holds it."""
    for p in (root / "packs").rglob("*.pack"):
        data = bytearray(p.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + delta] ^= 1
            p.write_bytes(bytes(data))
            return
    raise AssertionError("needle not found")


@pytest.mark.parametrize("id_check", [True, False])
def test_a_flipped_payload_byte_is_caught(tmp_path, id_check):
    payload = _noise(200_000, 3)
    with open_store(tmp_path / "store") as store:
        with store.writer() as w:
            oid = w.put(KIND, payload)
    _flip_in_record(tmp_path / "store", payload[1000:1032], 5)
    with engine.open(str(tmp_path / "store")) as store:
        with pytest.raises(CorruptObject):
            store.get_into(oid, KIND, 0, memoryview(bytearray(len(payload))),
                           id_check=id_check)
    assert os.path.exists(tmp_path / "store")


@pytest.mark.parametrize("id_check", [True, False])
def test_a_flipped_ref_byte_is_caught(tmp_path, id_check):
    """With the id re-hash the record checksum is not computed too: the refs (in the
    header, not in the payload) are still covered, by the id hash or by the checksum."""
    payload = _noise(100_000, 4)
    with open_store(tmp_path / "store") as store:
        with store.writer() as w:
            base = w.put(KIND, b"base")
            oid = w.put(KIND, payload, [base])
            w.set_root("r", oid)
    _flip_in_record(tmp_path / "store", oid + base, 16 + 3)  # the header ends in oid, refs
    with engine.open(str(tmp_path / "store")) as store:
        with pytest.raises(CorruptObject):
            store.get_into(oid, KIND, 0, memoryview(bytearray(len(payload))),
                           id_check=id_check)


def test_a_flipped_checksum_alone_leaves_a_checked_read_intact_and_verify_reports_it(
        tmp_path):
    """The id re-hash proves the payload and refs are the writer's, so a read that does
    it returns them even when only the checksum field is damaged; a read without it, a
    plain ``get`` and a deep verify report the damage."""
    payload = _noise(100_000, 5)
    with open_store(tmp_path / "store") as store:
        with store.writer() as w:
            oid = w.put(KIND, payload)
            w.set_root("r", oid)
    _flip_in_record(tmp_path / "store", payload[-64:], 64)  # the first checksum byte
    with engine.open(str(tmp_path / "store")) as store:
        out = bytearray(len(payload))
        store.get_into(oid, KIND, 0, memoryview(out), id_check=True)
        assert bytes(out) == payload
        with pytest.raises(CorruptObject):
            store.get_into(oid, KIND, 0, memoryview(out), id_check=False)
        with pytest.raises(CorruptObject):
            store.get(oid)
        assert not store.verify(deep=True).ok


def test_prefetch_is_a_hint(tmp_path):
    from engine.errors import StoreClosed

    with open_store(tmp_path / "store") as store:
        with store.writer() as w:
            leaf = w.put(KIND, _noise(100_000, 4))
            top = w.put(KIND + 1, b"node", (leaf,))
        store.prefetch([top, b"\x00" * 16])  # closure walked; an unknown id is skipped
        assert store.get(leaf).payload == _noise(100_000, 4)
    with pytest.raises(StoreClosed):
        store.prefetch([top])
    MemoryStore().prefetch([top])  # no-op

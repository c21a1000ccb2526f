"""Byte formats of engine/format/records.py: round trips, codec choice, and decoders that raise
nothing but CorruptObject on malformed input (docs/FORMAT.md "Records", "Trailer")."""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import struct

import msgpack
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.errors import CorruptObject
from engine.format import records as fmt
from engine.format import trailer
from engine.format.ids import object_id

CCTX = zstandard.ZstdCompressor(level=3)
ids = st.binary(min_size=16, max_size=16)
kinds = st.integers(0, 255)
payloads = st.one_of(
    st.binary(max_size=2048),
    st.integers(0, 5000).map(lambda n: b"ab" * n),  # compressible
)


def record(kind=1, refs=(), payload=b"x" * 1000, cctx=CCTX, rtype=fmt.RECORD_OBJECT):
    oid = object_id(kind, refs, payload) if rtype == fmt.RECORD_OBJECT else fmt.snapshot_id(
        payload)
    return fmt.encode_record(rtype, kind, tuple(refs), payload, oid, cctx=cctx), oid


@settings(max_examples=60, deadline=None)
@given(kind=kinds, refs=st.lists(ids, max_size=5), payload=payloads,
       compress=st.booleans(), prefix=st.binary(max_size=40))
def test_record_round_trip(kind, refs, payload, compress, prefix):
    data, oid = record(kind, refs, payload, CCTX if compress else None)
    buf = prefix + data + b"trailing junk"
    rec = fmt.decode_record(buf, len(prefix))
    assert rec.payload == payload
    assert rec.refs == tuple(refs)
    assert rec.header.oid == oid and rec.header.kind == kind
    assert rec.header.length == len(data)
    assert fmt.check_record(buf, len(prefix)) == rec.header


def test_codec_choice_zstd_for_compressible_raw_for_random():
    packed, _ = record(payload=b"abc" * 10_000)
    assert fmt.RecordHeader.unpack(packed).codec == fmt.CODEC_ZSTD
    assert len(packed) < 3000
    noise = os.urandom(10_000)
    raw, _ = record(payload=noise)
    head = fmt.RecordHeader.unpack(raw)
    assert head.codec == fmt.CODEC_RAW and head.stored_len == len(noise)
    off, _ = record(payload=b"abc" * 10_000, cctx=None)
    assert fmt.RecordHeader.unpack(off).codec == fmt.CODEC_RAW


def test_codec_stays_raw_when_saving_is_under_three_percent():
    # 98% incompressible noise + 2% zeros: zstd saves ~2%, below MIN_SAVING (10%).
    payload = os.urandom(9800) + bytes(200)
    data, _ = record(payload=payload)
    assert fmt.RecordHeader.unpack(data).codec == fmt.CODEC_RAW
    assert fmt.decode_record(data).payload == payload


def test_every_flipped_byte_is_caught():
    data, _ = record(refs=(b"r" * 16,), payload=b"hello world " * 50)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(CorruptObject):
            fmt.decode_record(bytes(bad))


def test_every_truncation_is_caught():
    data, _ = record(payload=b"payload" * 40)
    for n in range(len(data)):
        with pytest.raises(CorruptObject) as info:
            fmt.decode_record(data[:n])
        assert info.value.offset == 0


def _reseal(body: bytes) -> bytes:
    """Give forged record bytes a valid checksum, as a malicious writer could."""
    return body + fmt.CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def test_forged_lengths_with_valid_checksum_raise_corrupt_without_allocating():
    payload = b"z" * 1000
    oid = object_id(1, (), payload)
    stored = CCTX.compress(payload)
    for raw_len in (999, 1001, 1 << 40, (1 << 64) - 1):
        head = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, fmt.FORMAT_VERSION, 0, 1,
                                      fmt.CODEC_ZSTD, 0, len(stored), raw_len, oid)
        with pytest.raises(CorruptObject):
            fmt.decode_record(_reseal(head + stored))
    # raw codec whose raw_len disagrees with its stored length
    head = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, fmt.FORMAT_VERSION, 0, 1, fmt.CODEC_RAW,
                                  0, 1000, 5000, oid)
    with pytest.raises(CorruptObject):
        fmt.decode_record(_reseal(head + payload))
    # a zstd frame that is not zstd at all
    head = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, fmt.FORMAT_VERSION, 0, 1, fmt.CODEC_ZSTD,
                                  0, 1000, 1000, oid)
    with pytest.raises(CorruptObject):
        fmt.decode_record(_reseal(head + payload))


def test_wrong_id_with_valid_checksum_is_corrupt():
    payload = b"abc"
    head = fmt.RECORD_HEADER.pack(fmt.RECORD_MAGIC, fmt.FORMAT_VERSION, 0, 1, fmt.CODEC_RAW,
                                  0, 3, 3, b"\x00" * 16)
    with pytest.raises(CorruptObject, match="hashes to"):
        fmt.decode_record(_reseal(head + payload))


@settings(max_examples=150, deadline=None)
@given(junk=st.binary(max_size=300), offset=st.integers(-2, 80))
def test_decoders_raise_only_corrupt_object_on_junk(junk, offset):
    decoders = [
        lambda: fmt.decode_record(junk, offset),
        lambda: fmt.check_record(junk, offset),
        lambda: fmt.PackHeader.unpack(junk),
        lambda: fmt.decode_snapshot(junk),
        lambda: trailer.parse_footer(junk[-trailer.FOOTER.size:], len(junk) + offset),
        lambda: trailer.decode_trailer(junk, max(offset, 0) % 8, 16),
    ]
    for decode in decoders:
        try:
            decode()
        except CorruptObject:
            pass


@settings(max_examples=80, deadline=None)
@given(pos=st.integers(0, 10_000), value=st.integers(0, 255), cut=st.integers(0, 10_000))
def test_mutated_records_raise_only_corrupt_object(pos, value, cut):
    data, _ = record(refs=(b"q" * 16,), payload=b"0123456789" * 30)
    bad = bytearray(data)
    bad[pos % len(bad)] = value
    bad = bytes(bad[: max(1, len(bad) - cut % 8)])
    try:
        rec = fmt.decode_record(bad)
    except CorruptObject:
        return
    assert bad == data and rec.payload == b"0123456789" * 30  # only an unchanged record decodes


def test_trailer_round_trip_and_damage():
    entries = [trailer.TrailerEntry(16 + 100 * i, 100, i % 2, bytes([i]) * 16) for i in range(5)]
    at = 16 + 500
    blob = trailer.encode_trailer(entries, at)
    size = at + len(blob)
    count, entries_offset = trailer.parse_footer(blob[-trailer.FOOTER.size:], size)
    assert (count, entries_offset) == (5, at)
    assert trailer.decode_trailer(blob, count, entries_offset) == entries
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 1
        with pytest.raises(CorruptObject):
            c, o = trailer.parse_footer(bytes(bad[-trailer.FOOTER.size:]), size)
            trailer.decode_trailer(bytes(bad), c, o)


def test_trailer_entry_pointing_past_the_records_is_corrupt():
    blob = trailer.encode_trailer([trailer.TrailerEntry(16, 10_000, 0, b"a" * 16)], 116)
    with pytest.raises(CorruptObject, match="out of range"):
        trailer.decode_trailer(blob, 1, 116)


def test_pack_header_round_trip_and_refusals():
    h = fmt.PackHeader(fmt.FORMAT_VERSION, True, 12345)
    assert fmt.PackHeader.unpack(h.pack()) == h
    with pytest.raises(CorruptObject, match="version"):
        fmt.PackHeader.unpack(struct.pack("<4sBB2xI4x", b"CNRP", 99, 0, 1))
    with pytest.raises(CorruptObject, match="magic"):
        fmt.PackHeader.unpack(b"XXXX" + h.pack()[4:])


def test_snapshot_round_trip_and_validation():
    roots = {"step-2": b"b" * 16, "step-1": b"a" * 16, "ünï": b"c" * 16}
    payload = fmt.encode_snapshot(7, roots)
    assert fmt.decode_snapshot(payload) == (7, roots)
    data, _ = record(kind=0, payload=payload, rtype=fmt.RECORD_ROOTS)
    assert fmt.decode_record(data).payload == payload
    for doc in ({"seq": -1, "roots": {}}, {"seq": 1, "roots": {"a": b"short"}}, [1, 2], {}):
        with pytest.raises(CorruptObject):
            fmt.decode_snapshot(msgpack.packb(doc))


GOLDEN = pathlib.Path(__file__).parent / "golden" / "v1"


def test_golden_v1_packs_still_open(tmp_path):
    """Packs written by format version 1 (index left out: it is derived) keep opening:
    the index is rebuilt from them and every object reads back as written."""
    path = tmp_path / "store"
    shutil.copytree(GOLDEN, path)
    with engine.open(path, create=False) as store:
        top = bytes.fromhex("9d0614451cef8b6f3947ff0eeae86aab")
        assert store.roots() == {"step-2": top}
        node = store.get(top)
        assert (node.kind, node.payload) == (2, b"table node 2")
        patch, raw = (store.get(r) for r in node.refs)
        assert patch.payload == b"patch" and raw.payload == random.Random(1).randbytes(3000)
        assert store.get(patch.refs[0]).payload == b"golden exact block " * 200
        assert store.verify(deep=True).ok
        assert store.stats().objects == 6  # step-1's node and empty block: gc fodder
        assert store.gc().objects_freed == 2


def test_atomic_write_replaces_whole_files_and_leaves_no_temp(tmp_path):
    from engine.fs.fileio import allocated_bytes, atomic_write

    target = tmp_path / "small.bin"
    atomic_write(target, b"first version")
    atomic_write(target, b"second")
    assert target.read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["small.bin"]
    assert allocated_bytes(target) > 0 and allocated_bytes(tmp_path / "gone") == 0


def test_large_incompressible_payload_is_stored_raw_and_compressible_one_zstd():
    cctx = zstandard.ZstdCompressor(level=1)
    noise = os.urandom(1 << 20)
    planes = os.urandom(3 << 18) + bytes(1 << 18)  # three noisy planes, one constant
    for payload, codec in ((noise, fmt.CODEC_RAW), (planes, fmt.CODEC_ZSTD)):
        oid = object_id(4, (), payload)
        parts = fmt.encode_record_parts(fmt.RECORD_OBJECT, 4, (), payload, oid, cctx=cctx)
        record = b"".join(parts)
        assert record == fmt.encode_record(fmt.RECORD_OBJECT, 4, (), payload, oid, cctx=cctx)
        assert fmt.RecordHeader.unpack(record, 0).codec == codec
        assert fmt.decode_record(record).payload == payload

"""Byte layouts of pack files: pack header, records, roots snapshots (the trailer: trailer.py).

Normative spec: docs/FORMAT.md. Section names are cited next to each constant. Every
decoder here raises only ``CorruptObject`` on malformed input, never struct, zstd,
msgpack, index or memory errors, and it validates every length against the buffer before
it allocates or decompresses anything.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import xxhash
import zstandard

from ..errors import CorruptObject
from .ids import ID_SIZE, check_kind, id_hasher, object_id
from .rootsrec import (  # noqa: F401 - roots records are part of the format
    RECORD_ROOTS,
    RECORD_ROOTS_DELTA,
    ROOTS_RECORDS,
    RootsRecord,
    decode_roots_record,
    decode_snapshot,
    encode_delta,
    encode_snapshot,
    snapshot_id,
)

FORMAT_VERSION = 1  # FORMAT.md "Format version"

# FORMAT.md "Pack files": 16-byte pack header.
PACK_MAGIC = b"CNRP"
PACK_HEADER = struct.Struct("<4sBB2xI4x")
PACK_FLAG_META = 0x01

# FORMAT.md "Records": 44-byte header, refs, stored payload, 8-byte checksum.
RECORD_MAGIC = b"CNRR"
RECORD_HEADER = struct.Struct("<4sBBBBIQQ16s")
CHECKSUM = struct.Struct("<Q")
RECORD_OBJECT = 0
CODEC_RAW = 0
CODEC_ZSTD = 1
# Store raw unless zstd saves at least this fraction (FORMAT.md "Records"): below it,
# decompressing costs a reader more than the bytes saved (docs/design/store-engine.md).
MIN_SAVING = 0.10
# Payloads this large are first probed with a sample of SAMPLE_SLICES evenly spaced slices:
# a sample that zstd cannot shrink by MIN_SAVING means the payload is stored raw without
# compressing all of it, which on incompressible data cost more than writing it.
SAMPLE_MIN = 64 << 10
SAMPLE_SLICES = 16
SAMPLE_SLICE = 1 << 10
# The sample must save PROBE_SAVING (not MIN_SAVING): for payloads this large,
# decompressing (~0.7 GB/s on whole fp32 rows) costs a reader more than the few percent
# of bytes it saves, and a raw record can be read straight into the reader's memory
# (docs/design/block-encoding.md, "Layout of a block").
PROBE_SAVING = 0.10
# zstd expands at most ~32768x (RLE blocks); a larger claimed raw_len cannot be genuine,
# so it is refused before any allocation (FORMAT.md "Records", decoding rules).
MAX_ZSTD_RATIO = 1 << 16
MAX_REFS = 1 << 20
# No payload is larger (puts refuse it), so no record may claim more (FORMAT.md "Records").
MAX_RAW_LEN = 1 << 32
# A zstd payload may expand up to this ratio (or to DIRECT_MIN bytes) before its id is
# known; one that claims more is first streamed through the id hash in STREAM_CHUNK
# pieces, and only allocated whole once it proved genuine. A crafted 33 KB record can
# no longer make a reader allocate a gigabyte before its id check fails.
DIRECT_RATIO = 1 << 10
DIRECT_MIN = 1 << 20
STREAM_CHUNK = 1 << 20

@dataclass(frozen=True)
class PackHeader:
    version: int
    meta: bool
    pack_no: int

    def pack(self) -> bytes:
        flags = PACK_FLAG_META if self.meta else 0
        return PACK_HEADER.pack(PACK_MAGIC, self.version, flags, self.pack_no)

    @classmethod
    def unpack(cls, buf: bytes, *, pack: str | None = None) -> PackHeader:
        if len(buf) < PACK_HEADER.size:
            raise CorruptObject(f"pack {pack}: header truncated", pack=pack, offset=0)
        magic, version, flags, pack_no = PACK_HEADER.unpack_from(buf, 0)
        if magic != PACK_MAGIC:
            raise CorruptObject(f"pack {pack}: bad pack magic {magic!r}", pack=pack, offset=0)
        if version != FORMAT_VERSION:
            raise CorruptObject(
                f"pack {pack}: unknown pack format version {version}", pack=pack, offset=0
            )
        return cls(version, bool(flags & PACK_FLAG_META), pack_no)


@dataclass(frozen=True)
class RecordHeader:
    rtype: int
    kind: int
    codec: int
    nrefs: int
    stored_len: int
    raw_len: int
    oid: bytes

    @property
    def length(self) -> int:
        """Total record length: header, refs, stored payload and checksum."""
        return RECORD_HEADER.size + ID_SIZE * self.nrefs + self.stored_len + CHECKSUM.size

    @classmethod
    def unpack(
        cls, buf: bytes | memoryview, offset: int = 0, *, pack: str | None = None
    ) -> RecordHeader:
        """Parse and sanity-check a header; the lengths it claims are not yet checked
        against the buffer (``record_length_ok`` does that)."""
        where = f"pack {pack} offset {offset}"
        if offset < 0 or len(buf) - offset < RECORD_HEADER.size:
            raise CorruptObject(f"{where}: record header truncated", pack=pack, offset=offset)
        magic, version, rtype, kind, codec, nrefs, stored, raw, oid = RECORD_HEADER.unpack_from(
            buf, offset
        )
        problem = None
        if magic != RECORD_MAGIC:
            problem = f"bad record magic {bytes(magic)!r}"
        elif version != FORMAT_VERSION:
            problem = f"unknown record format version {version}"
        elif rtype not in (RECORD_OBJECT, *ROOTS_RECORDS):
            problem = f"unknown record type {rtype}"
        elif codec not in (CODEC_RAW, CODEC_ZSTD):
            problem = f"unknown codec {codec}"
        elif nrefs > MAX_REFS:
            problem = f"implausible ref count {nrefs}"
        elif codec == CODEC_RAW and raw != stored:
            problem = f"raw record with raw_len {raw} != stored_len {stored}"
        elif codec == CODEC_ZSTD and raw > max(stored, 64) * MAX_ZSTD_RATIO:
            problem = f"raw_len {raw} impossible for {stored} zstd bytes"
        elif raw > MAX_RAW_LEN:
            problem = f"raw_len {raw} exceeds the largest payload a store holds"
        if problem:
            raise CorruptObject(f"{where}: {problem}", oid=bytes(oid), pack=pack, offset=offset)
        return cls(rtype, kind, codec, nrefs, stored, raw, bytes(oid))


@dataclass(frozen=True)
class Record:
    header: RecordHeader
    refs: tuple[bytes, ...]
    payload: bytes  # uncompressed (a read-only memoryview where decode_record was asked)


def encode_record(*args: Any, **kwargs: Any) -> bytes:
    """One record as bytes: ``encode_record_parts`` joined (same arguments)."""
    return b"".join(encode_record_parts(*args, **kwargs))


def encode_record_parts(
    rtype: int,
    kind: int,
    refs: tuple[bytes, ...],
    payload: bytes,
    oid: bytes,
    *,
    cctx: zstandard.ZstdCompressor | None,
) -> tuple[bytes, bytes | memoryview, bytes]:
    """Encode one record (``cctx=None`` stores the payload raw) as (header + refs, stored
    payload, checksum), to be written back to back
    (``os.writev``) without joining copies of the payload."""
    codec, stored = CODEC_RAW, payload
    if cctx is not None and payload and _worth_compressing(cctx, payload):
        packed = cctx.compress(payload)
        if len(packed) <= len(payload) * (1.0 - MIN_SAVING):
            codec, stored = CODEC_ZSTD, packed
    head = RECORD_HEADER.pack(
        RECORD_MAGIC, FORMAT_VERSION, rtype, kind, codec, len(refs), len(stored),
        len(payload), oid,
    )
    head = b"".join((head, *refs))
    h = xxhash.xxh3_64(head)
    h.update(stored)
    return head, stored, CHECKSUM.pack(h.intdigest())


def _worth_compressing(cctx: zstandard.ZstdCompressor, payload: bytes) -> bool:
    n = len(payload)
    if n < SAMPLE_MIN:
        return True
    view = memoryview(payload)
    step = n // SAMPLE_SLICES
    sample = b"".join(view[i * step : i * step + SAMPLE_SLICE] for i in range(SAMPLE_SLICES))
    return len(cctx.compress(sample)) <= len(sample) * (1.0 - PROBE_SAVING)


def check_record(
    buf: bytes | memoryview, offset: int = 0, *, pack: str | None = None
) -> RecordHeader:
    """Validate header, lengths and checksum of the record at ``offset`` (no decompression).

    Used where records are copied verbatim (gc) or scanned (repair)."""
    header = RecordHeader.unpack(buf, offset, pack=pack)
    end = offset + header.length
    if end > len(buf):
        raise CorruptObject(
            f"pack {pack} offset {offset}: record of {header.length} bytes overruns its "
            f"{len(buf) - offset} available bytes",
            oid=header.oid, pack=pack, offset=offset,
        )
    body = memoryview(buf)[offset : end - CHECKSUM.size]
    (stored_sum,) = CHECKSUM.unpack_from(buf, end - CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(body) != stored_sum:
        raise CorruptObject(
            f"pack {pack} offset {offset}: checksum mismatch in record of object "
            f"{header.oid.hex()}",
            oid=header.oid, pack=pack, offset=offset,
        )
    return header


def decode_record(
    buf: bytes | memoryview,
    offset: int = 0,
    *,
    pack: str | None = None,
    dctx: zstandard.ZstdDecompressor | None = None,
    raw_len: int | None = None,
    as_view: bool = False,
) -> Record:
    """Fully decode the record at ``offset``: checksum, bounded decompression, id check.
    ``raw_len``: the payload length the index (or a location) gives; a header claiming
    another is refused before anything is decompressed, so what a reader checked against
    the index (cnrstore bounds node and block sizes by it) is what gets allocated.
    ``as_view``: a raw payload of a read-only ``buf`` is a view of it, not a copy (a batched
    read's records, cut out of one read: engine/store/batchread.py)."""
    header = check_record(buf, offset, pack=pack)
    where = f"pack {pack} offset {offset}, object {header.oid.hex()}"
    _check_raw_len(header, raw_len, where, pack, offset)
    pos = offset + RECORD_HEADER.size
    view = memoryview(buf)
    refs = tuple(
        bytes(view[pos + i * ID_SIZE : pos + (i + 1) * ID_SIZE]) for i in range(header.nrefs)
    )
    pos += ID_SIZE * header.nrefs
    stored = view[pos : pos + header.stored_len]
    payload: bytes | memoryview
    if header.codec == CODEC_RAW:
        keep_view = as_view and stored.readonly and header.rtype == RECORD_OBJECT
        payload = stored if keep_view else bytes(stored)
    else:
        kind, id_refs = (header.kind, refs) if header.rtype == RECORD_OBJECT else (0, ())
        if header.raw_len > max(len(stored) * DIRECT_RATIO, DIRECT_MIN):
            _stream_check(stored, header, kind, id_refs, dctx, where, pack, offset)
        payload = _decompress(stored, header.raw_len, dctx, where, header.oid, pack, offset)
    if header.rtype == RECORD_OBJECT:
        try:
            actual = object_id(header.kind, refs, payload)
        except ValueError as exc:
            raise CorruptObject(f"{where}: {exc}", oid=header.oid, pack=pack,
                                offset=offset) from exc
    else:
        actual = snapshot_id(bytes(payload))  # bytes already: an object's payload alone is a view
    if actual != header.oid:
        raise CorruptObject(
            f"{where}: content hashes to {actual.hex()}, not its id",
            oid=header.oid, pack=pack, offset=offset,
        )
    return Record(header, refs, cast(bytes, payload))


def _check_raw_len(header: RecordHeader, raw_len: int | None, where: str, pack: str | None,
                   offset: int) -> None:
    if raw_len is not None and header.raw_len != raw_len:
        raise CorruptObject(f"{where}: record claims a {header.raw_len}-byte payload, its "
                            f"index entry {raw_len}", oid=header.oid, pack=pack,
                            offset=offset)


def check_payload(buf: bytes | memoryview, offset: int = 0, *, pack: str | None = None,
                  dctx: zstandard.ZstdDecompressor | None = None,
                  raw_len: int | None = None) -> Record:
    """``decode_record``'s checks without keeping an object's payload (deep verify,
    repair's scan): a zstd payload is streamed through the id hash in STREAM_CHUNK pieces,
    so checking a record never holds more than its stored bytes and one chunk, whatever
    it expands to. The Record returned has an empty payload (a roots record: its own)."""
    header = check_record(buf, offset, pack=pack)
    where = f"pack {pack} offset {offset}, object {header.oid.hex()}"
    _check_raw_len(header, raw_len, where, pack, offset)
    pos = offset + RECORD_HEADER.size
    view = memoryview(buf)
    refs = tuple(
        bytes(view[pos + i * ID_SIZE : pos + (i + 1) * ID_SIZE]) for i in range(header.nrefs)
    )
    stored = view[pos + ID_SIZE * header.nrefs : pos + ID_SIZE * header.nrefs
                  + header.stored_len]
    if header.rtype != RECORD_OBJECT:
        return decode_record(buf, offset, pack=pack, dctx=dctx, raw_len=raw_len)  # small
    if header.codec == CODEC_ZSTD:
        try:  # as _decompress requires, so what verify passes ``get`` reads
            size = zstandard.frame_content_size(stored)
        except zstandard.ZstdError as exc:
            raise CorruptObject(f"{where}: cannot decompress: {exc}", oid=header.oid,
                                pack=pack, offset=offset) from exc
        if size != header.raw_len:
            raise CorruptObject(f"{where}: zstd frame claims {size} bytes, header says "
                                f"{header.raw_len}", oid=header.oid, pack=pack, offset=offset)
        _stream_check(stored, header, header.kind, refs, dctx, where, pack, offset)
    else:
        try:
            h = id_hasher(header.kind, refs, header.raw_len)
        except ValueError as exc:
            raise CorruptObject(f"{where}: {exc}", oid=header.oid, pack=pack,
                                offset=offset) from exc
        h.update(stored)
        if h.digest() != header.oid:
            raise CorruptObject(f"{where}: content does not match its id",
                                oid=header.oid, pack=pack, offset=offset)
    return Record(header, refs, b"")


def _stream_check(stored: bytes | memoryview, header: RecordHeader, kind: int,
                  refs: tuple[bytes, ...], dctx: zstandard.ZstdDecompressor | None, where: str,
                  pack: str | None, offset: int | None) -> None:
    """Decompress in bounded pieces through the id hash, keeping none of it: raises
    CorruptObject unless the payload is exactly raw_len bytes that hash to the id."""
    try:
        h = id_hasher(kind, refs, header.raw_len)
        reader = (dctx or zstandard.ZstdDecompressor()).stream_reader(stored)
        total = 0
        while total <= header.raw_len:
            chunk = reader.read(STREAM_CHUNK)
            if not chunk:
                break
            total += len(chunk)
            h.update(chunk)
    except (zstandard.ZstdError, ValueError, MemoryError) as exc:
        raise CorruptObject(f"{where}: cannot decompress: {exc}", oid=header.oid, pack=pack,
                            offset=offset) from exc
    if total != header.raw_len or h.digest() != header.oid:
        raise CorruptObject(f"{where}: content does not match its id (checked while "
                            "streaming, before allocating it)", oid=header.oid, pack=pack,
                            offset=offset)


def _decompress(stored: bytes | memoryview, raw_len: int,
                dctx: zstandard.ZstdDecompressor | None, where: str, oid: bytes,
                pack: str | None, offset: int | None) -> bytes:
    try:
        # Our writer always records the content size; trusting only a size that matches
        # the header keeps the allocation bounded by the (already checked) raw_len.
        size = zstandard.frame_content_size(stored)
        if size != raw_len:
            raise CorruptObject(
                f"{where}: zstd frame claims {size} bytes, header says {raw_len}",
                oid=oid, pack=pack, offset=offset,
            )
        out = (dctx or zstandard.ZstdDecompressor()).decompress(stored, max_output_size=raw_len)
    except CorruptObject:
        raise
    except (zstandard.ZstdError, ValueError, MemoryError) as exc:
        raise CorruptObject(f"{where}: cannot decompress: {exc}", oid=oid, pack=pack,
                            offset=offset) from exc
    if len(out) != raw_len:
        raise CorruptObject(f"{where}: decompressed to {len(out)} bytes, expected {raw_len}",
                            oid=oid, pack=pack, offset=offset)
    return out


def checked_object(kind: int, payload: bytes | bytearray | memoryview,
                   refs: Sequence[bytes]) -> tuple[bytes, tuple[bytes, ...]]:
    """The argument checks every put shares (the store's writer, a rank's PackSink and the
    in-memory twin): the payload and refs as bytes, or TypeError/ValueError before anything
    is written."""
    check_kind(kind)
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes-like, got {type(payload).__name__}")
    if isinstance(refs, (bytes, bytearray, str)):
        raise TypeError("refs must be a sequence of object ids, not a single bytes/str")
    payload = bytes(payload)
    if len(payload) > MAX_RAW_LEN:
        raise ValueError(f"payload of {len(payload)} bytes exceeds the "
                         f"{MAX_RAW_LEN}-byte limit (FORMAT.md \"Records\")")
    return payload, tuple(bytes(r) for r in refs)

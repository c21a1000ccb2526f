"""The pack trailer: the list of a pack's records at its end, so that a pack can be
indexed without scanning it (docs/FORMAT.md "Trailer"). Decoders raise only
``CorruptObject`` and check every length before they allocate."""

from __future__ import annotations

import os
import pathlib
import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from ..errors import CorruptObject
from .records import CHECKSUM, FORMAT_VERSION, PACK_HEADER, RECORD_ROOTS_DELTA

# FORMAT.md "Trailer": 33-byte entries then a 28-byte footer at the very end of the file.
TRAILER_ENTRY = struct.Struct("<QQB16s")
TRAILER_MAGIC = b"CNRT"
FOOTER = struct.Struct("<4sB3xIQQ")


@dataclass(frozen=True)
class TrailerEntry:
    offset: int
    length: int
    rtype: int
    oid: bytes


def encode_trailer(entries: list[TrailerEntry], entries_offset: int) -> bytes:
    body = b"".join(TRAILER_ENTRY.pack(e.offset, e.length, e.rtype, e.oid) for e in entries)
    footer_head = FOOTER.pack(TRAILER_MAGIC, FORMAT_VERSION, len(entries), entries_offset, 0)
    footer_head = footer_head[: -CHECKSUM.size]
    checksum = xxhash.xxh3_64_intdigest(body + footer_head)
    return body + footer_head + CHECKSUM.pack(checksum)


def parse_footer(buf: bytes, file_size: int, *, pack: str | None = None) -> tuple[int, int]:
    """Return (count, entries_offset) from the last FOOTER.size bytes of a pack."""
    at = file_size - FOOTER.size
    if len(buf) != FOOTER.size or file_size < PACK_HEADER.size + FOOTER.size:
        raise CorruptObject(f"pack {pack}: no room for a trailer", pack=pack, offset=at)
    magic, version, count, entries_offset, _ = FOOTER.unpack(buf)
    if magic != TRAILER_MAGIC or version != FORMAT_VERSION:
        raise CorruptObject(f"pack {pack}: no valid trailer (unsealed or damaged)", pack=pack,
                            offset=at)
    if entries_offset < PACK_HEADER.size or entries_offset + count * TRAILER_ENTRY.size != at:
        raise CorruptObject(f"pack {pack}: trailer lengths inconsistent", pack=pack, offset=at)
    return count, entries_offset


def decode_trailer(
    buf: bytes, count: int, entries_offset: int, *, pack: str | None = None
) -> list[TrailerEntry]:
    """Decode entries + footer (``buf`` runs from entries_offset to the end of the pack)."""
    if len(buf) != count * TRAILER_ENTRY.size + FOOTER.size:
        raise CorruptObject(f"pack {pack}: trailer truncated", pack=pack, offset=entries_offset)
    (stored_sum,) = CHECKSUM.unpack_from(buf, len(buf) - CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(memoryview(buf)[: -CHECKSUM.size]) != stored_sum:
        raise CorruptObject(f"pack {pack}: trailer checksum mismatch", pack=pack,
                            offset=entries_offset)
    entries = []
    for i in range(count):
        off, length, rtype, oid = TRAILER_ENTRY.unpack_from(buf, i * TRAILER_ENTRY.size)
        if off < PACK_HEADER.size or off + length > entries_offset or rtype > RECORD_ROOTS_DELTA:
            raise CorruptObject(f"pack {pack}: trailer entry {i} out of range", pack=pack,
                                offset=entries_offset)
        entries.append(TrailerEntry(off, length, rtype, oid))
    return entries


def read_trailer_of(size: int, read: Callable[[int, int], bytes], *,
                    name: str) -> list[TrailerEntry]:
    """Entries of the sealed pack ``name`` of ``size`` bytes, whose bytes ``read(offset,
    length)`` returns (a file, a ranged GET): its footer, then its entries. CorruptObject
    when it has no valid trailer. The one trailer reader."""
    if size < PACK_HEADER.size + FOOTER.size:
        raise CorruptObject(f"pack {name}: too short for a trailer", pack=name, offset=0)
    footer = read(size - FOOTER.size, FOOTER.size)
    count, entries_offset = parse_footer(footer, size, pack=name)
    return decode_trailer(read(entries_offset, size - entries_offset), count, entries_offset,
                          pack=name)


def read_trailer(path: pathlib.Path, *, name: str) -> list[TrailerEntry]:
    """Entries of a sealed pack file; CorruptObject if it has no valid trailer."""
    with open(path, "rb") as f:
        def read(offset: int, length: int) -> bytes:
            f.seek(offset)
            return f.read(length)

        return read_trailer_of(os.fstat(f.fileno()).st_size, read, name=name)

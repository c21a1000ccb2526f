"""``RecordLocation``: where one object record lies in a pack, as a distributed put passes
it between processes (docs/FORMAT.md "Distributed commit").

A location carries what an index entry holds (pack, offset, length, kind, raw_len, meta
flag, refs), so a process without the index can read and id-check the record, and the
coordinator can adopt it into its commit. Thousands cross a gloo ``all_gather_object`` per
step, so the wire form is plain and compact: a tuple of ints and bytes (refs joined), and
``encode_locations`` packs many into one bytes value.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from .ids import ID_SIZE

# id 16s | kind B | meta B | nrefs I | pack I | offset Q | length Q | raw_len Q, then refs
_FIXED = struct.Struct("<16sBBIIQQQ")
_BATCH_MAGIC = b"CNRL\x01"

Wire = tuple[bytes, int, bytes, int, int, int, int, bool]


@dataclass(frozen=True)
class RecordLocation:
    oid: bytes
    kind: int
    refs: tuple[bytes, ...]
    pack: int
    offset: int
    length: int
    raw_len: int
    meta: bool

    def to_wire(self) -> Wire:
        """A plain tuple (bytes, ints, bool): picklable and msgpack-able."""
        return (self.oid, self.kind, b"".join(self.refs), self.pack, self.offset,
                self.length, self.raw_len, self.meta)

    @classmethod
    def from_wire(cls, wire: Iterable[Any]) -> RecordLocation:
        """Inverse of ``to_wire`` (msgpack may hand back a list); FormatError when the
        value is not a well-formed location."""
        try:
            oid, kind, refs, pack, offset, length, raw_len, meta = wire
        except (TypeError, ValueError):
            raise FormatError(f"malformed record location {wire!r}") from None
        ints = (kind, pack, offset, length, raw_len)
        if (not isinstance(oid, (bytes, bytearray)) or len(oid) != ID_SIZE
                or not isinstance(refs, (bytes, bytearray)) or len(refs) % ID_SIZE
                or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in ints)
                or kind > 255 or pack >= 1 << 32 or not isinstance(meta, bool)):
            raise FormatError(f"malformed record location {wire!r}")
        refs = bytes(refs)
        split = tuple(refs[i : i + ID_SIZE] for i in range(0, len(refs), ID_SIZE))
        return cls(bytes(oid), kind, split, pack, offset, length, raw_len, meta)


def encode_locations(locs: Iterable[RecordLocation]) -> bytes:
    """Many locations as one bytes value (40 + 16 * nrefs bytes each)."""
    parts = [_BATCH_MAGIC]
    for loc in locs:
        parts.append(_FIXED.pack(loc.oid, loc.kind, 1 if loc.meta else 0, len(loc.refs),
                                 loc.pack, loc.offset, loc.length, loc.raw_len))
        parts.extend(loc.refs)
    return b"".join(parts)


def decode_locations(data: bytes | bytearray | memoryview) -> list[RecordLocation]:
    """Inverse of ``encode_locations``; FormatError on anything else."""
    buf = bytes(data)
    if not buf.startswith(_BATCH_MAGIC):
        raise FormatError("not an encoded list of record locations")
    out = []
    pos = len(_BATCH_MAGIC)
    while pos < len(buf):
        if pos + _FIXED.size > len(buf):
            raise FormatError(f"record locations truncated at byte {pos}")
        oid, kind, meta, nrefs, pack, offset, length, raw_len = _FIXED.unpack_from(buf, pos)
        pos += _FIXED.size
        end = pos + nrefs * ID_SIZE
        if end > len(buf) or meta > 1:
            raise FormatError(f"record locations malformed at byte {pos}")
        refs = tuple(buf[i : i + ID_SIZE] for i in range(pos, end, ID_SIZE))
        pos = end
        out.append(RecordLocation(oid, kind, refs, pack, offset, length, raw_len,
                                  bool(meta)))
    return out

"""Values of the index's ``objects`` and ``packs`` databases (docs/FORMAT.md "Index").

Object entries end in a checksum over key and value: gc follows the refs they hold, so a
flipped bit must be detected, not followed (or not followed past) into a sweep.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from ..errors import CorruptObject
from ..format.ids import ID_SIZE, hexid
from .lmdbcheck import DamagedIndex

# FORMAT.md "Index": value layouts.
OBJECT_VALUE = struct.Struct("<IQQBQBI")
ENTRY_SUM = struct.Struct("<Q")  # xxh3_64(key | value before it)
PACK_KEY = struct.Struct(">I")  # big-endian so cursor order is pack order
PACK_VALUE = struct.Struct("<QQQBI")
FLAG_META = 0x01


@dataclass(frozen=True)
class ObjectEntry:
    pack: int
    offset: int
    length: int
    kind: int
    raw_len: int
    meta: bool
    refs: tuple[bytes, ...]

    def encode(self, oid: bytes) -> bytes:
        """The value stored under ``oid``, ending in a checksum over key and value: gc
        follows these refs, so one flipped bit must not make it sweep a live object."""
        head = OBJECT_VALUE.pack(self.pack, self.offset, self.length, self.kind, self.raw_len,
                                 FLAG_META if self.meta else 0, len(self.refs))
        body = head + b"".join(self.refs)
        return body + ENTRY_SUM.pack(xxhash.xxh3_64_intdigest(bytes(oid) + body))

    @classmethod
    def decode(cls, buf: bytes, oid: bytes, *, legacy_ok: bool = False) -> ObjectEntry:
        """Decode and check the entry of ``oid``. ``legacy_ok`` accepts the checksum-less
        entries of indexes written before entry checksums (until they are upgraded)."""
        try:
            pack, off, length, kind, raw, flags, n = OBJECT_VALUE.unpack_from(buf, 0)
        except struct.error as exc:
            raise _bad_entry(oid, f"malformed ({exc})") from None
        base = OBJECT_VALUE.size
        end = base + n * ID_SIZE
        if len(buf) == end + ENTRY_SUM.size:
            (stored,) = ENTRY_SUM.unpack_from(buf, end)
            if xxhash.xxh3_64_intdigest(bytes(oid) + bytes(buf[:end])) != stored:
                raise _bad_entry(oid, "fails its checksum")
        elif len(buf) != end or not legacy_ok:
            raise _bad_entry(oid, "has a bad length or ref count")
        refs = tuple(bytes(buf[base + i * ID_SIZE : base + (i + 1) * ID_SIZE]) for i in range(n))
        return cls(pack, off, length, kind, raw, bool(flags & FLAG_META), refs)


def _bad_entry(oid: bytes, what: str) -> CorruptObject:
    return CorruptObject(f"index entry of object {hexid(oid)} {what} (repair rebuilds the "
                         "index from the packs)", oid=bytes(oid))


@dataclass(frozen=True)
class PackEntry:
    size: int    # file size, header and trailer included
    total: int   # bytes of object records written (the base of the dead fraction)
    live: int    # bytes of object records still indexed
    meta: bool
    count: int   # object records still indexed

    def encode(self) -> bytes:
        flags = FLAG_META if self.meta else 0
        return PACK_VALUE.pack(self.size, self.total, self.live, flags, self.count)

    @classmethod
    def decode(cls, buf: bytes) -> PackEntry:
        try:
            size, total, live, flags, count = PACK_VALUE.unpack(buf)
        except struct.error as exc:
            raise DamagedIndex(f"malformed pack entry in index: {exc}") from exc
        return cls(size, total, live, bool(flags & FLAG_META), count)

    @property
    def dead_fraction(self) -> float:
        """Share of the object bytes no longer indexed (1.0 for a pack without objects)."""
        return 1.0 if self.total == 0 else (self.total - self.live) / self.total


def pack_key(n: int) -> bytes:
    return PACK_KEY.pack(n)


def unpack_pack_key(key: bytes | memoryview) -> int:
    if len(key) != PACK_KEY.size:
        raise DamagedIndex(f"malformed pack key {bytes(key)!r} in index")
    return PACK_KEY.unpack(key)[0]

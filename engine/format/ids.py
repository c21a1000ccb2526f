"""Object ids: the 128-bit xxh3 of a canonical encoding of (kind, refs, payload).

The id covers the *uncompressed* payload, so compression settings never change an id
(docs/FORMAT.md, "Object ids"). The canonical encoding is::

    b"cnr1" | kind: u8 | nrefs: u32 le | refs: 16 bytes each | len(payload): u64 le | payload
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

ID_SIZE = 16
MAX_KIND = 255
_DOMAIN = b"cnr1"
_HEAD = struct.Struct("<BI")
_LEN = struct.Struct("<Q")


def object_id(kind: int, refs: Sequence[bytes], payload: bytes | bytearray | memoryview) -> bytes:
    """Return the 16-byte id of an object. Validates kind and refs."""
    h = id_hasher(kind, refs, len(payload))
    h.update(payload)
    return h.digest()


def id_hasher(kind: int, refs: Sequence[bytes], length: int) -> xxhash.xxh3_128:
    """The id hash fed up to the payload: ``update`` it with the payload's ``length``
    bytes (in pieces, if need be), then ``digest()`` is the object id."""
    check_kind(kind)
    h = xxhash.xxh3_128(_DOMAIN)
    h.update(_HEAD.pack(kind, len(refs)))
    for ref in refs:
        check_id(ref)
        h.update(ref)
    h.update(_LEN.pack(length))
    return h


def check_kind(kind: int) -> None:
    if not isinstance(kind, int) or isinstance(kind, bool) or not 0 <= kind <= MAX_KIND:
        raise ValueError(f"object kind must be an int in 0..{MAX_KIND}, got {kind!r}")


def check_id(oid: bytes) -> None:
    if not isinstance(oid, (bytes, bytearray)) or len(oid) != ID_SIZE:
        raise ValueError(f"object id must be {ID_SIZE} bytes, got {oid!r}")


MAX_ROOT_NAME = 511  # LMDB's default key size limit, in utf-8 bytes


def check_root_name(name: str) -> bytes:
    """The utf-8 key of a root name; ValueError/TypeError for what no store may hold."""
    if not isinstance(name, str):
        raise TypeError(f"root name must be a str, got {type(name).__name__}")
    try:
        key = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"root name {name!r} is not valid unicode: {exc}") from None
    if not 0 < len(key) <= MAX_ROOT_NAME:
        raise ValueError(f"root name must be 1..{MAX_ROOT_NAME} utf-8 bytes, got {name!r}")
    return key


def hexid(oid: bytes) -> str:
    return bytes(oid).hex()

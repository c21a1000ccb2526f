"""Helpers for the index's ``meta`` database, used inside transactions (docs/FORMAT.md
"Index"): counters, the roots chain, the roots checksum and the meta checksum."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import lmdb
import msgpack
import xxhash

from .lmdbcheck import DamagedIndex


class _Tables(Protocol):
    """The databases of an ``Index`` (engine/index/db.py) these helpers read."""

    meta: Any
    roots: Any

U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
# A transaction as our callbacks use it. lmdb's stubs type every value bytes | memoryview;
# ours are bytes (no transaction is opened with buffers=True), hence Any over the stubs.
Txn = Any

META_VERSION = b"format_version"
META_OPTIONS = b"options"
META_META_SUM = b"meta_checksum"  # u64 meta_digest of the values in META_SUMMED
# The meta values written once, when an index is created: a flipped bit in the version
# made a healthy store unopenable ("upgrade cnrstore"), one in the options silently
# changed the tuning of every later open. Counters that every commit moves are not here.
META_SUMMED = (META_VERSION, META_OPTIONS)
META_SEQ = b"commit_seq"
META_NEXT_PACK = b"next_pack"
META_SNAPSHOT_PACK = b"snapshot_pack"
META_CHAIN = b"roots_chain"  # msgpack [packs of the current roots chain, delta bytes, full]
META_ROOTS_SUM = b"roots_checksum"  # u64 roots_digest of the roots db


def get_u64(txn: lmdb.Transaction, db: Any, key: bytes) -> int:
    raw = txn.get(key, db=db)
    return U64.unpack(raw)[0] if raw is not None else 0


# Pack numbers are u32 in a pack's header. next_pack (no checksum: every commit moves it)
# past them is a flipped high bit, which made every later write fail with a struct error,
# and a repair keeps the old value (lest it reuse a deleted pack's number) so kept it so.
PACK_NUMBERS = 1 << 32


def get_next_pack(txn: lmdb.Transaction, db: Any) -> int:
    """``next_pack``; DamagedIndex when it is past the pack numbers."""
    n = get_u64(txn, db, META_NEXT_PACK)
    if n > PACK_NUMBERS:
        raise DamagedIndex(f"the index's next pack number {n} is past the largest a pack "
                           "can have (a damaged meta table; repair rebuilds the index)")
    return n


def get_snapshot_pack(txn: lmdb.Transaction, db: Any) -> int:
    raw = txn.get(META_SNAPSHOT_PACK, db=db)
    return I64.unpack(raw)[0] if raw is not None else -1


def get_chain(txn: lmdb.Transaction, db: Any) -> tuple[list[int], int, int]:
    """(packs holding the current roots chain: its full snapshot and the deltas since,
    payload bytes of those deltas, payload bytes of that full snapshot). An empty list
    demands a full snapshot next."""
    raw = txn.get(META_CHAIN, db=db)
    if raw is None:  # an index from before roots deltas: every snapshot was full
        n = get_snapshot_pack(txn, db)
        return ([n] if n >= 0 else []), 0, 0
    try:
        packs, delta_bytes, full_bytes = msgpack.unpackb(raw)
        return [int(n) for n in packs], int(delta_bytes), int(full_bytes)
    except Exception:  # damaged: a fresh full snapshot repairs it
        return [], 0, 0


_MASK = (1 << 64) - 1


def root_hash(name: str | bytes, oid: bytes) -> int:
    key = name.encode("utf-8") if isinstance(name, str) else bytes(name)
    return xxhash.xxh3_64_intdigest(b"".join((U64.pack(len(key)), key, bytes(oid))))


def roots_digest(roots: dict) -> bytes:
    """Checksum of a whole root map (keys str or utf-8 bytes): the sum mod 2^64 of each
    root's ``root_hash``, so a commit updates it from the roots it changes alone. A flipped
    bit in the roots db could otherwise hide roots from gc, which would sweep their DAGs."""
    return U64.pack(sum(root_hash(k, v) for k, v in roots.items()) & _MASK)


def updated_digest(digest: bytes, old: Mapping, new: Mapping) -> bytes:
    """``digest`` after the roots in ``old`` (name -> id, or None: absent) became ``new``."""
    (value,) = U64.unpack(digest)
    for name, oid in old.items():
        if oid is not None:
            value -= root_hash(name, oid)
    for name, oid in new.items():
        if oid is not None:
            value += root_hash(name, oid)
    return U64.pack(value & _MASK)


def roots_problem(txn: lmdb.Transaction, index: _Tables) -> str | None:
    """Why the roots db cannot be trusted (it fails its checksum), or None."""
    stored = txn.get(META_ROOTS_SUM, db=index.meta)
    if stored is None:
        return None  # an index from before roots checksums: upgraded on open
    roots = {bytes(k): bytes(v) for k, v in txn.cursor(db=index.roots)}
    if roots_digest(roots) != bytes(stored):
        return "the index's roots fail their checksum (damaged roots table)"
    return None


def chain_value(packs: Iterable[int], delta_bytes: int, full_bytes: int) -> bytes:
    return msgpack.packb([sorted(set(packs)), int(delta_bytes), int(full_bytes)])


_ABSENT = U64.pack(_MASK)  # a summed key that is not there (no value is 2^64-1 bytes long)


def meta_digest(values: Mapping[bytes, bytes | None]) -> bytes:
    """Checksum of the META_SUMMED values (absent ones included as absent)."""
    parts = []
    for key in META_SUMMED:
        value = values.get(key)
        parts += [U64.pack(len(key)), key]
        parts += [_ABSENT] if value is None else [U64.pack(len(value)), bytes(value)]
    return U64.pack(xxhash.xxh3_64_intdigest(b"".join(parts)))


def summed_values(txn: lmdb.Transaction, db: Any) -> dict[bytes, bytes | None]:
    return {key: (None if (v := txn.get(key, db=db)) is None else bytes(v))
            for key in META_SUMMED}


def meta_problem(txn: lmdb.Transaction, db: Any) -> str | None:
    """Why the META_SUMMED values cannot be trusted (they fail their checksum), or None.
    An index without the checksum (from before it) is accepted: a writable open adds it."""
    stored = txn.get(META_META_SUM, db=db)
    if stored is None:
        return None
    if bytes(stored) != meta_digest(summed_values(txn, db)):
        return "its format version or options fail their checksum (a damaged meta table)"
    return None


def put_meta_checksum(txn: lmdb.Transaction, db: Any) -> None:
    """Checksum the META_SUMMED values as they are now (a new index, or one from before
    the checksum, whose version was just checked)."""
    txn.put(META_META_SUM, meta_digest(summed_values(txn, db)), db=db)

"""The local index's side of a bucket store's commit documents: the meta keys a cache
keeps (the sequence applied, the location it caches, gc's dirty mark, retired packs, the
damage it was rebuilt around), the pack entries a document carries, and applying one.

engine/storage/remote.py runs the commit protocol against the bucket; this is what a
commit means to the LMDB cache, shared with the writer and gc (which publish documents
of their own) and kept apart from the protocol so each stays one concept.
"""

from __future__ import annotations

import msgpack

from ..errors import CorruptObject
from . import db as ix

__all__ = ["META_REMOTE_DAMAGED", "META_REMOTE_DIRTY", "META_REMOTE_ID", "META_REMOTE_SEQ",
           "META_RETIRED", "apply_commit", "meta_get", "pack_doc", "record_seq"]

META_REMOTE_SEQ = b"remote_seq"        # u64: newest commit document applied
META_REMOTE_ID = b"remote_location"    # utf-8: the bucket location this index caches
META_REMOTE_DIRTY = b"remote_dirty"    # present while a gc changed the cache unpublished
META_RETIRED = b"remote_retired"       # msgpack {pack: unix time its gc commit retired it}
META_REMOTE_DAMAGED = b"remote_damaged"  # msgpack [message]: rebuilt from packs around these


def pack_doc(n: int, size: int, meta: bool,
             entries: list[tuple[bytes, ix.ObjectEntry]]) -> list:
    return [n, size, meta, [[oid, e.offset, e.length, e.kind, e.raw_len, list(e.refs)]
                            for oid, e in entries]]


def meta_get(txn: ix.Txn, index: ix.Index, key: bytes) -> bytes | None:
    raw = txn.get(key, db=index.meta)
    return None if raw is None else bytes(raw)


def apply_commit(txn: ix.Txn, index: ix.Index, doc: dict) -> None:
    """Make the cache in ``txn`` reflect commit ``doc`` (its predecessor already applied)."""
    for oid in doc.get("swept", ()):
        raw = txn.get(oid, db=index.objects)
        if raw is None:
            continue
        txn.delete(oid, db=index.objects)
        try:
            e = index.entry(oid, raw)
        except CorruptObject:
            continue
        praw = txn.get(ix.pack_key(e.pack), db=index.packs)
        if praw is not None:
            p = ix.PackEntry.decode(praw)
            p = ix.PackEntry(p.size, p.total, max(0, p.live - e.length), p.meta,
                             max(0, p.count - 1))
            txn.put(ix.pack_key(e.pack), p.encode(), db=index.packs)
    retired = msgpack.unpackb(meta_get(txn, index, META_RETIRED) or b"\x80", strict_map_key=False)
    for n in doc.get("gone", ()):
        txn.delete(ix.pack_key(n), db=index.packs)
        retired[n] = doc["time"]
    next_pack = ix.get_u64(txn, index.meta, ix.META_NEXT_PACK)
    for n, size, meta, entries in doc.get("packs", ()):
        total = 0
        for oid, offset, length, kind, raw_len, refs in entries:
            entry = ix.ObjectEntry(n, offset, length, kind, raw_len, bool(meta), tuple(refs))
            txn.put(oid, entry.encode(oid), db=index.objects)
            total += length
        txn.put(ix.pack_key(n), ix.PackEntry(size, total, total, bool(meta),
                                             len(entries)).encode(), db=index.packs)
        next_pack = max(next_pack, n + 1)
    changes: dict[str, bytes | None] = dict(doc.get("set", {}))
    changes.update({name: None for name in doc.get("del", ())})
    if changes:
        old = {}
        for name in changes:
            v = txn.get(name.encode("utf-8"), db=index.roots)
            old[name] = None if v is None else bytes(v)
        for name, target in changes.items():
            if target is None:
                txn.delete(name.encode("utf-8"), db=index.roots)
            else:
                txn.put(name.encode("utf-8"), target, db=index.roots)
        digest = meta_get(txn, index, ix.META_ROOTS_SUM)
        if digest is None:
            digest = ix.roots_digest({bytes(k): bytes(v) for k, v in txn.cursor(db=index.roots)})
        else:
            digest = ix.updated_digest(digest, old, changes)
        txn.put(ix.META_ROOTS_SUM, digest, db=index.meta)
        # The roots records in this cache's meta packs no longer describe the map: the
        # next local commit writes a full snapshot.
        txn.put(ix.META_CHAIN, ix.chain_value([], 0, 0), db=index.meta)
    txn.put(ix.META_NEXT_PACK, ix.U64.pack(next_pack), db=index.meta)
    record_seq(txn, index, doc["seq"])
    if doc.get("gone"):
        txn.put(META_RETIRED, msgpack.packb(retired), db=index.meta)


def record_seq(txn: ix.Txn, index: ix.Index, seq: int) -> None:
    """In the transaction that applies or publishes commit ``seq``."""
    txn.put(META_REMOTE_SEQ, ix.U64.pack(seq), db=index.meta)
    # Roots records written here carry the bucket's sequence (a copy of the bucket is
    # then a directory store that repair can read).
    if ix.get_u64(txn, index.meta, ix.META_SEQ) < seq:
        txn.put(ix.META_SEQ, ix.U64.pack(seq), db=index.meta)
    txn.delete(META_REMOTE_DIRTY, db=index.meta)

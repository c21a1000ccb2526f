"""The local index's side of a bucket store's commit documents: the meta keys a cache
keeps (the sequence applied, the location it caches, gc's dirty mark, retired packs, the
damage it was rebuilt around), the pack entries a document carries, and applying one.

engine/store/commit/bucket.py runs the commit protocol against the bucket. Every commit
reaches LMDB through ``apply_change`` here: a writer's, a gc's, and another cache's (its
document, ``apply_commit``), whether the store is local or a bucket's cache.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import msgpack

from ..errors import CorruptObject, RootExists
from ..format.commitdoc import CommitDoc, EntryDoc, PackDoc
from . import db as ix

__all__ = ["META_REMOTE_DAMAGED", "META_REMOTE_DIRTY", "META_REMOTE_ID", "META_REMOTE_SEQ",
           "META_RETIRED", "IndexChange", "apply_change", "apply_commit", "meta_get",
           "pack_doc", "record_seq"]

META_REMOTE_SEQ = b"remote_seq"        # u64: newest commit document applied
META_REMOTE_ID = b"remote_location"    # utf-8: the bucket location this index caches
META_REMOTE_DIRTY = b"remote_dirty"    # present while a gc changed the cache unpublished
META_RETIRED = b"remote_retired"       # msgpack {pack: unix time its gc commit retired it}
META_REMOTE_DAMAGED = b"remote_damaged"  # msgpack [message]: rebuilt from packs around these


def pack_doc(n: int, size: int, meta: bool,
             entries: list[tuple[bytes, ix.ObjectEntry]]) -> PackDoc:
    return PackDoc(n, size, meta, tuple(EntryDoc(oid, e.offset, e.length, e.kind, e.raw_len,
                                                 tuple(e.refs)) for oid, e in entries))


def meta_get(txn: ix.Txn, index: ix.Index, key: bytes) -> bytes | None:
    raw = txn.get(key, db=index.meta)
    return None if raw is None else bytes(raw)


@dataclass(frozen=True)
class IndexChange:
    """What one commit changes in an index: a writer's and a gc's own commits (which also
    move the roots chain they wrote into their meta packs) and another cache's commit
    document (``of_document``) all take this form, and ``apply_change`` writes it."""

    objects: Mapping[bytes, ix.ObjectEntry] = field(default_factory=dict)
    packs: Mapping[int, ix.PackEntry] = field(default_factory=dict)
    gone: Collection[int] = ()        # packs the commit retired
    swept: Sequence[bytes] = ()       # ids another cache's gc dropped (lower live bytes)
    roots: Mapping[str, bytes | None] = field(default_factory=dict)  # None: deleted
    creates: Collection[str] = ()     # names that must not exist yet (RootExists)
    next_pack: int = 0                # next_pack becomes at least this
    remote_seq: int | None = None     # the bucket commit this is (record_seq)
    retired_at: float | None = None   # gone packs retire at this time (a cache's gc grace)
    seq: int | None = None            # the commit's roots sequence, snapshot pack,
    snapshot_pack: int | None = None  # roots chain and roots checksum, as the committer
    chain: bytes | None = None        # wrote them; roots moved without a checksum: the
    roots_sum: bytes | None = None    # cache derives it and its chain restarts

    @classmethod
    def of_document(cls, doc: CommitDoc) -> IndexChange:
        """Another cache's commit, from its document alone."""
        objects: dict[bytes, ix.ObjectEntry] = {}
        packs: dict[int, ix.PackEntry] = {}
        for n, size, meta, entries in doc.packs:
            total = 0
            for oid, offset, length, kind, raw_len, refs in entries:
                objects[oid] = ix.ObjectEntry(n, offset, length, kind, raw_len, bool(meta),
                                              tuple(refs))
                total += length
            packs[n] = ix.PackEntry(size, total, total, bool(meta), len(entries))
        roots: dict[str, bytes | None] = dict(doc.sets)
        roots.update({name: None for name in doc.deletes})
        return cls(objects=objects, packs=packs, gone=doc.gone, swept=doc.swept, roots=roots,
                   next_pack=max((p.number + 1 for p in doc.packs), default=0),
                   remote_seq=doc.seq, retired_at=doc.time)


def apply_commit(txn: ix.Txn, index: ix.Index, doc: CommitDoc) -> None:
    """Make the cache in ``txn`` reflect commit ``doc`` (its predecessor already applied)."""
    apply_change(txn, index, IndexChange.of_document(doc))


def apply_change(txn: ix.Txn, index: ix.Index, change: IndexChange) -> None:
    """The one place a commit reaches the index, inside its publishing transaction: raises
    RootExists (aborting it whole) when a name the commit creates exists."""
    if change.remote_seq is not None:
        record_seq(txn, index, change.remote_seq)
    for name in sorted(change.creates):
        # Checked inside the publishing transaction: raising aborts it whole.
        if txn.get(name.encode("utf-8"), db=index.roots) is not None:
            raise RootExists(f"root {name!r} already exists; nothing of this "
                             "transaction was published", name=name)
    for oid in change.swept:
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
    retired = None
    if change.retired_at is not None and change.gone:
        retired = msgpack.unpackb(meta_get(txn, index, META_RETIRED) or b"\x80",
                                  strict_map_key=False)
    for n in change.gone:
        txn.delete(ix.pack_key(n), db=index.packs)
        if retired is not None:
            retired[n] = change.retired_at
    for oid, entry in change.objects.items():
        txn.put(oid, entry.encode(oid), db=index.objects)
    for n, packed in change.packs.items():
        txn.put(ix.pack_key(n), packed.encode(), db=index.packs)
    if change.roots:
        _move_roots(txn, index, change.roots, derive=change.roots_sum is None)
    next_pack = max(change.next_pack, ix.get_next_pack(txn, index.meta))
    txn.put(ix.META_NEXT_PACK, ix.U64.pack(next_pack), db=index.meta)
    if change.seq is not None:
        txn.put(ix.META_SEQ, ix.U64.pack(change.seq), db=index.meta)
        txn.put(ix.META_SNAPSHOT_PACK, ix.I64.pack(change.snapshot_pack), db=index.meta)
    if change.chain is not None:
        txn.put(ix.META_CHAIN, change.chain, db=index.meta)
    if change.roots_sum is not None:
        txn.put(ix.META_ROOTS_SUM, change.roots_sum, db=index.meta)
    if retired is not None:
        txn.put(META_RETIRED, msgpack.packb(retired), db=index.meta)


def _move_roots(txn: ix.Txn, index: ix.Index, changes: Mapping[str, bytes | None], *,
                derive: bool) -> None:
    old = {}
    if derive:
        for name in changes:
            v = txn.get(name.encode("utf-8"), db=index.roots)
            old[name] = None if v is None else bytes(v)
    for name, target in changes.items():
        if target is None:
            txn.delete(name.encode("utf-8"), db=index.roots)
        else:
            txn.put(name.encode("utf-8"), target, db=index.roots)
    if not derive:
        return
    digest = meta_get(txn, index, ix.META_ROOTS_SUM)
    if digest is None:
        digest = ix.roots_digest({bytes(k): bytes(v) for k, v in txn.cursor(db=index.roots)})
    else:
        digest = ix.updated_digest(digest, old, changes)
    txn.put(ix.META_ROOTS_SUM, digest, db=index.meta)
    # The roots records in this cache's meta packs no longer describe the map: the next
    # local commit writes a full snapshot.
    txn.put(ix.META_CHAIN, ix.chain_value([], 0, 0), db=index.meta)


def record_seq(txn: ix.Txn, index: ix.Index, seq: int) -> None:
    """In the transaction that applies or publishes commit ``seq``."""
    txn.put(META_REMOTE_SEQ, ix.U64.pack(seq), db=index.meta)
    # Roots records written here carry the bucket's sequence (a copy of the bucket is
    # then a directory store that repair can read).
    if ix.get_u64(txn, index.meta, ix.META_SEQ) < seq:
        txn.put(ix.META_SEQ, ix.U64.pack(seq), db=index.meta)
    txn.delete(META_REMOTE_DIRTY, db=index.meta)

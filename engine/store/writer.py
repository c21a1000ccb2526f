"""The pack store's write transaction (docs/FORMAT.md "Write ordering: commit").

Puts are appended to fresh pack files as they come (so a large transaction never sits in
memory); commit seals and fsyncs the packs, then publishes everything in ONE LMDB write
transaction. Until that transaction commits, nothing of this writer is visible, and a crash
leaves only unindexed pack files that gc or repair reclaims.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import zstandard

from ..api import CommitInfo, ObjectStore, Writer
from ..errors import (
    CommitSequenceTaken,
    CorruptObject,
    ObjectNotFound,
    RootExists,
    StoreClosed,
    StoreError,
)
from ..format import records as fmt
from ..format.commitdoc import CommitDoc
from ..format.ids import check_id, check_root_name, hexid, object_id
from ..format.location import RecordLocation
from ..format.records import checked_object
from ..fs import crashpoints
from ..fs.fileio import store_error
from ..index import db as ix
from ..index.commits import IndexChange, apply_change, pack_doc
from ..packs import pack as pk
from ..packs.pack import PackSet
from .adopt import Adoption

if TYPE_CHECKING:
    from .core import PackStoreState




class PackWriter(Writer):
    """Created by ``PackStore.writer`` with the writer lock held; ``done(self)`` releases
    it when the writer commits or aborts. ``owner`` answers ``has`` and ``root`` for what
    is already published."""

    def __init__(self, core: PackStoreState, owner: ObjectStore,
                 done: Callable[[Writer], None]) -> None:
        self._core = core
        self._store = owner
        self._done_cb = done
        self._index = core.index
        next_pack = self._index.read(lambda t: ix.get_next_pack(t, self._index.meta))
        self._packs = PackSet(core.storage, next_pack, core.options.pack_target_size)
        # A bucket store commits as the successor of the commit its cache showed now.
        self._base = core.log.seq(core)
        self._remote_seq: int | None = None
        self._started = time.time()  # before any of its packs was uploaded
        self._level = core.options.compression_level
        self._local = threading.local()  # zstd compressors are not thread-safe
        self._lock = threading.Lock()  # puts from several threads append one at a time
        self._new: dict[bytes, ix.ObjectEntry] = {}
        self._roots: dict[str, bytes | None] = {}
        self._creates: set[str] = set()  # names that must not exist at commit
        self._chain = b""  # the META_CHAIN value this commit publishes
        self._roots_sum = b""
        self._reused = 0
        self._bytes = 0
        self._payload_new = 0
        self._done = False
        self._broken: BaseException | None = None
        self._adoption: Adoption | None = None  # records ranks wrote (engine/store/adopt.py)

    def _check(self) -> None:
        if self._done:
            raise StoreClosed("writer already committed or aborted")
        self._core.check_open()
        if self._broken is not None:
            raise StoreError(f"writer failed earlier and must be aborted: {self._broken}")

    def has(self, oid: bytes) -> bool:
        check_id(oid)
        oid = bytes(oid)
        return oid in self._new or self._adopted(oid) or self._store.has(oid)

    def missing(self, oids: Iterable[bytes]) -> set[bytes]:
        wanted = []
        for oid in oids:
            check_id(oid)
            wanted.append(bytes(oid))
        return self._absent(tuple(wanted))

    def _adopted(self, oid: bytes) -> bool:
        return self._adoption is not None and oid in self._adoption.locs

    def adopt(self, locs: Sequence[RecordLocation]) -> None:
        """Publish, in this writer's commit, records another process wrote and sealed into
        reserved packs (docs/FORMAT.md "Distributed commit"; checks in engine/store/adopt.py).
        All of ``locs`` or none are taken; ids already held count as reused."""
        self._check()
        with self._lock:
            if self._adoption is None:
                self._adoption = Adoption(self._core)
            own = {pf.number for pf in self._packs.files}
            self._adoption.add(locs, pending=self._new, own_packs=own)
            oldest = self._adoption.oldest  # a bucket commit's age counts from rank packs
            self._started = min(self._started, oldest if oldest is not None else self._started)
        crashpoints.hit("adopt.after_check")

    @property
    def adopted_packs(self) -> set[int]:
        """Every pack a location given to ``adopt`` named (adopted, or skipped because
        its ids were held already): the leases over them end with this writer."""
        return set() if self._adoption is None else set(self._adoption.named)

    def put(
        self,
        kind: int,
        payload: bytes | bytearray | memoryview,
        refs: Sequence[bytes] = (),
        *,
        meta: bool = False,
    ) -> bytes:
        self._check()
        payload, refs = checked_object(kind, payload, refs)
        oid = object_id(kind, refs, payload)  # validates every ref's shape
        absent = self._absent((oid, *refs))
        for ref in refs:
            if ref in absent:
                raise ObjectNotFound(f"ref {hexid(ref)} does not exist", oid=ref)
        if oid not in absent:
            with self._lock:
                self._reused += 1
            return oid
        # Compress outside the lock, so puts from several threads compress in parallel.
        record = fmt.encode_record_parts(fmt.RECORD_OBJECT, kind, refs, payload, oid,
                                         cctx=self._compressor())
        length = pk.record_length(record)
        with self._lock:
            self._check()
            if oid in self._new or self._adopted(oid):  # another thread put it meanwhile
                self._reused += 1
                return oid
            try:
                pack, offset = self._packs.append(record, fmt.RECORD_OBJECT, oid,
                                                  meta=bool(meta))
            except OSError as exc:
                self._broken = exc
                raise store_error("cannot append to pack", exc) from exc
            self._new[oid] = ix.ObjectEntry(pack, offset, length, kind, len(payload),
                                            bool(meta), refs)
            self._bytes += length
            self._payload_new += len(payload)
        return oid

    @property
    def payload_bytes_new(self) -> int:
        adopted = 0 if self._adoption is None else self._adoption.payload_new
        return self._payload_new + adopted

    def _absent(self, oids: tuple[bytes, ...]) -> set[bytes]:
        """Those of ``oids`` neither put in this writer nor indexed (one read txn)."""
        pending = [o for o in oids if o not in self._new and not self._adopted(o)]
        if not pending:
            return set()
        db = self._index.objects
        return self._index.read(lambda t: {o for o in pending if t.get(o, db=db) is None})

    def _compressor(self) -> zstandard.ZstdCompressor | None:
        if self._level == 0:
            return None
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(level=self._level)
        return cctx

    def set_root(self, name: str, oid: bytes) -> None:
        self._check()
        check_root_name(name)
        check_id(oid)
        if not self.has(oid):
            raise ObjectNotFound(f"root target {hexid(oid)} does not exist", oid=bytes(oid))
        self._roots[name] = bytes(oid)

    def create_root(self, name: str, oid: bytes) -> None:
        self._check()
        check_root_name(name)
        pending = name in self._roots  # deleted earlier in this writer: a plain move
        current = self._roots[name] if pending else self._store.root(name)
        if current is not None:
            raise RootExists(f"root {name!r} already exists", name=name)
        self.set_root(name, oid)
        if not pending:
            self._creates.add(name)

    def delete_root(self, name: str) -> None:
        self._check()
        check_root_name(name)
        current = self._roots[name] if name in self._roots else self._store.root(name)
        if current is None:
            raise ObjectNotFound(f"root {name!r} does not exist", name=name)
        self._roots[name] = None
        self._creates.discard(name)

    def commit(self) -> CommitInfo:
        with self._lock:  # no put may land between here and the seal
            if self._done:
                raise StoreClosed("writer already committed or aborted")
            self._done = True
        published = keep_uploaded = False
        try:  # from here on, any failure discards the packs and releases the lock
            self._core.check_open()
            if self._broken is not None:
                raise StoreError(f"cannot commit: a put failed earlier: {self._broken}")
            adoption = self._adoption
            if not self._new and not self._roots and not (adoption and adoption.locs):
                return CommitInfo(0, 0, self._reused + (adoption.reused if adoption else 0))
            if adoption is not None:
                adoption.check_refs(self._new)
                adoption.sync()  # rank packs durable before this commit's roots record
            seq, snapshot_pack = self._append_snapshot()
            crashpoints.hit("writer.after_pack_write")
            self._packs.seal_and_sync()
            crashpoints.hit("writer.after_pack_fsync")
            log = self._core.log
            log.check_age(self._started)
            # Past this point a published commit's document may exist (a timeout does not
            # say it does not): its packs are deleted only on a certain loss.
            keep_uploaded = log.publishes
            try:
                self._remote_seq = log.publish(self._core, self._base, self._commit_doc)
            except (RootExists, CommitSequenceTaken):
                keep_uploaded = False  # another writer's document holds the number
                raise
            if log.publishes:
                crashpoints.hit("writer.after_remote_commit")
            self._index.write(lambda txn: self._publish(txn, seq, snapshot_pack))
            published = True
            crashpoints.hit("writer.after_index_commit")
            if adoption is not None:
                return CommitInfo(self._bytes + adoption.bytes_new,
                                  len(self._new) + len(adoption.locs),
                                  self._reused + adoption.reused)
            return CommitInfo(self._bytes, len(self._new), self._reused)
        except OSError as exc:
            raise store_error("commit failed", exc) from exc
        finally:
            self._packs.close()
            if not published:
                self._packs.discard(keep_uploaded=keep_uploaded)
            self._done_cb(self)

    def _append_snapshot(self) -> tuple[int | None, int | None]:
        """Append a roots record to the meta pack when this commit moves roots
        (FORMAT.md "Roots snapshots"): repair recovers roots from these alone. A delta
        (the names this commit set or deleted, O(changes) to write and to check in) until
        the deltas since the last full snapshot add up to its size: snapshots then cost
        linear, not quadratic, space in the number of roots kept."""
        if not self._roots:
            return None, None
        index = self._index
        delta = fmt.encode_delta(0, self._roots)  # sized once; re-encoded with its seq

        def current(txn: ix.Txn) -> tuple[
                int, tuple[list[int], int, int], bytes | None, dict[str, bytes | None],
                dict[str, bytes] | None]:
            seq = ix.get_u64(txn, index.meta, ix.META_SEQ)
            chain = ix.get_chain(txn, index.meta)
            digest = txn.get(ix.META_ROOTS_SUM, db=index.meta)
            old = {n: txn.get(n.encode("utf-8"), db=index.roots) for n in self._roots}
            old = {n: None if v is None else bytes(v) for n, v in old.items()}
            chain_packs, delta_bytes, full_bytes = chain
            full = not chain_packs or digest is None or (
                delta_bytes + len(delta) > full_bytes)
            roots = None
            if full:  # the whole map goes to disk: it must be the one the checksum names
                problem = ix.roots_problem(txn, index)
                if problem is not None:
                    raise CorruptObject(f"cannot commit: {problem}; run repair")
                roots = {k.decode(): bytes(v) for k, v in txn.cursor(db=index.roots)}
            return seq, chain, digest, old, roots

        seq, (chain, delta_bytes, full_bytes), digest, old, roots = index.read(current)
        seq += 1
        if roots is None:
            assert digest is not None  # no digest demands a full snapshot (see current)
            payload, rtype = fmt.encode_delta(seq, self._roots), fmt.RECORD_ROOTS_DELTA
            self._roots_sum = ix.updated_digest(digest, old, self._roots)
        else:
            for name, oid in self._roots.items():
                if oid is None:
                    roots.pop(name, None)
                else:
                    roots[name] = oid
            payload, rtype = fmt.encode_snapshot(seq, roots), fmt.RECORD_ROOTS
            self._roots_sum = ix.roots_digest(roots)
        sid = fmt.snapshot_id(payload)
        record = fmt.encode_record(rtype, 0, (), payload, sid, cctx=self._compressor())
        self._bytes += len(record)
        pack, _ = self._packs.append(record, rtype, sid, meta=True)
        if rtype == fmt.RECORD_ROOTS:
            self._chain = ix.chain_value([pack], 0, len(payload))
        else:
            self._chain = ix.chain_value([*chain, pack], delta_bytes + len(payload),
                                         full_bytes)
        return seq, pack

    def _commit_doc(self) -> CommitDoc:
        """What a bucket store's commit object records (engine/store/commit/bucket.py)."""
        by_pack: dict[int, list[tuple[bytes, ix.ObjectEntry]]] = {}
        for oid, entry in self._new.items():
            by_pack.setdefault(entry.pack, []).append((oid, entry))
        return CommitDoc(
            kind="put",
            packs=tuple(pack_doc(pf.number, pf.size, pf.meta, by_pack.get(pf.number, []))
                        for pf in self._packs.files)
            + (self._adoption.pack_docs() if self._adoption is not None else ()),
            sets={n: t for n, t in self._roots.items() if t is not None},
            deletes=tuple(sorted(n for n, t in self._roots.items() if t is None)),
            creates=tuple(sorted(self._creates)))

    def _publish(self, txn: ix.Txn, seq: int | None,
                 snapshot_pack: int | None) -> None:
        objects = dict(self._new)
        packs = {pf.number: ix.PackEntry(pf.size, pf.live, pf.live, pf.meta, pf.objects)
                 for pf in self._packs.files}
        if self._adoption is not None:
            objects.update(self._adoption.entries())
            packs.update(self._adoption.pack_entries())
        moved = seq is not None
        apply_change(txn, self._index, IndexChange(
            objects=objects, packs=packs, roots=self._roots, creates=self._creates,
            next_pack=self._packs.next_number, remote_seq=self._remote_seq, seq=seq,
            snapshot_pack=snapshot_pack, chain=self._chain if moved else None,
            roots_sum=self._roots_sum if moved else None))

    def __del__(self) -> None:
        # A writer dropped without commit or abort must not keep the store locked.
        try:
            if not self._done and os.getpid() == self._core.pid:
                self.abort()
        except Exception:
            pass

    def abort(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        try:
            self._packs.discard()
        except OSError as exc:
            raise store_error("abort could not delete its packs (gc reclaims them)",
                              exc) from exc
        finally:
            self._done_cb(self)

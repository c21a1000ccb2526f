"""Garbage collection: mark, sweep, compact, delete (docs/FORMAT.md "Garbage collection").

Runs with the writer lock held. Each phase ends in a state a crash may leave behind:

1. mark: walk refs from every root through the index alone (payloads are never read);
2. sweep: ONE transaction drops dead object entries and lowers their packs' live bytes;
3. compact: live records of mostly-dead packs, and of small packs (merged, so that many
   tiny puts end up in a few files), are copied verbatim (checksum checked) into new
   packs (with the roots records of the chain packs among them, or a fresh snapshot
   when a chain pack is dropped), which are sealed and fsync'ed; ONE transaction moves
   their entries and drops the old packs' entries;
4. delete: only now are the old pack files, and files no index entry lists (crash
   leftovers), unlinked. A reader whose older transaction still names a deleted pack gets
   FileNotFoundError, looks the object up again and finds its new place.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..api import Problem, ProgressFn, StoreGCReport
from ..errors import CommitSequenceTaken, CorruptObject, GCRefused
from ..format import records as fmt
from ..format import trailer
from ..format.commitdoc import CommitDoc
from ..format.ids import ID_SIZE, hexid
from ..fs import crashpoints
from ..fs.fileio import store_error
from ..index import db as ix
from ..index.commits import IndexChange, apply_change, pack_doc
from ..packs.pack import PackSet, pack_name
from .gcplan import Plan, plan_packs
from .lease import leased
from .rootschain import chain_holds
from .walk import Via, describe, walk

if TYPE_CHECKING:
    from .core import PackStoreState


def mark(index: ix.Index) -> dict[bytes, int]:
    """Ids reachable from the roots, following refs kept in the index, with the pack each
    lives in. Raises GCRefused (nothing swept yet) when a reachable ref is missing or its
    entry fails its checksum: sweeping on a graph we cannot trust could delete live data."""

    def read(txn: Any) -> dict[bytes, int]:
        live: dict[bytes, int] = {}
        problem = ix.roots_problem(txn, index)
        if problem is not None:
            raise GCRefused(f"gc refused: {problem}; run repair first")
        starts = []
        for key, value in txn.cursor(db=index.roots):
            try:
                name = bytes(key).decode("utf-8")
            except UnicodeDecodeError:
                raise GCRefused(f"gc refused: root name {bytes(key)!r} is not utf-8 (a "
                                "damaged index); run repair first") from None
            if len(value) != ID_SIZE:
                raise GCRefused(f"gc refused: root {bytes(key)!r} holds a malformed id; "
                                "run repair first")
            starts.append((bytes(value), name))

        def refs_of(oid: bytes, via: Via) -> tuple[bytes, ...]:
            raw = txn.get(oid, db=index.objects)
            if raw is None:
                raise GCRefused(f"gc refused: reachable object {hexid(oid)} (ref of "
                                f"{describe(via)}) is not in the index (missing or damaged "
                                "entry); run repair first", oid=oid)
            try:
                entry = index.entry(oid, raw)
            except CorruptObject as exc:
                raise GCRefused(f"gc refused: {exc}", oid=oid) from exc
            live[oid] = entry.pack
            return entry.refs

        walk(starts, refs_of)
        return live

    return index.read(read)


def sweep(index: ix.Index, live: dict[bytes, int], swept: list[bytes] | None = None) -> int:
    """Drop every unmarked object entry; return how many were dropped (their ids are
    appended to ``swept`` when given)."""

    def apply(txn: ix.Txn) -> int:
        dead: dict[int, list[int]] = {}
        keys = []
        for key, raw in txn.cursor(db=index.objects):
            if key not in live:
                keys.append(key)
                try:
                    entry = index.entry(key, raw)
                except CorruptObject:
                    continue  # unreachable either way; its pack's counts stay as they were
                acc = dead.setdefault(entry.pack, [0, 0])
                acc[0] += entry.length
                acc[1] += 1
        for key in keys:
            txn.delete(key, db=index.objects)
        if swept is not None:
            swept[:] = [bytes(k) for k in keys]
        for n, (nbytes, count) in dead.items():
            raw = txn.get(ix.pack_key(n), db=index.packs)
            if raw is None:
                continue
            p = ix.PackEntry.decode(raw)
            p = ix.PackEntry(p.size, p.total, max(0, p.live - nbytes), p.meta,
                             max(0, p.count - count))
            txn.put(ix.pack_key(n), p.encode(), db=index.packs)
        return len(keys)

    return index.write(apply)


@dataclass
class _Copied:
    moves: dict[bytes, ix.ObjectEntry] = field(default_factory=dict)
    chain: set[int] = field(default_factory=set)  # new packs holding copied chain records
    snapshot_pack: int | None = None  # where the newest roots record went, if it moved


def _copy_live(store: PackStoreState, plan: Plan, out: PackSet, unreadable: list[Problem],
               *, copy_chain: bool) -> _Copied:
    """Copy the live records of ``plan.rewrite`` into ``out`` and, with ``copy_chain``,
    the roots records of its packs in the roots chain (so a merge of small packs needs
    no fresh snapshot, whose higher sequence would make a gc killed before its commit
    look like a lost commit). Packs that cannot be read cleanly are left in place (and
    out of the plan), listed in ``unreadable``."""
    index = store.index
    copied = _Copied()
    kept = []
    for n in plan.rewrite:
        name = pack_name(n)
        try:
            entries = store.storage.read_trailer(n)
            live = index.read(functools.partial(_live_entries, index=index, n=n,
                                                entries=entries))
            roots = [t for t in entries if t.rtype in fmt.ROOTS_RECORDS] if (
                copy_chain and n in plan.chain) else []
            spans = [(e.offset, e.length) for _, e in live]
            spans += [(t.offset, t.length) for t in roots]
            # From a bucket, one GET of the pack beats one per live record.
            whole = store.storage.read_all(n) if store.storage.remote and spans else None
            datas = []
            for offset, length in spans:
                if whole is not None:
                    data = whole[offset:offset + length]
                    if len(data) != length:
                        raise CorruptObject(f"pack {name} is shorter than its records",
                                            pack=name, offset=offset)
                else:
                    data = store.readers.read(n, offset, length)
                fmt.check_record(data, 0, pack=name)
                datas.append(data)
        except CorruptObject as exc:
            unreadable.append(Problem("corrupt", f"gc left pack {name} in place: {exc}",
                                      oid=exc.oid, pack=name, offset=exc.offset))
            continue
        except OSError as exc:
            unreadable.append(Problem("unreadable", f"gc left pack {name} in place: {exc}",
                                      pack=name))
            continue
        for (oid, e), data in zip(live, datas):
            pack, offset = out.append(data, fmt.RECORD_OBJECT, oid, meta=plan.meta[n])
            copied.moves[oid] = ix.ObjectEntry(pack, offset, e.length, e.kind, e.raw_len,
                                               e.meta, e.refs)
        for t, data in zip(roots, datas[len(live):]):
            pack, _ = out.append(data, t.rtype, t.oid, meta=True)  # roots: meta packs only
            copied.chain.add(pack)
            if n == plan.snapshot_pack:
                copied.snapshot_pack = pack
        kept.append(n)
    plan.rewrite = kept
    return copied


def _live_entries(txn: Any, index: ix.Index, n: int, entries: list[trailer.TrailerEntry]
                  ) -> list[tuple[bytes, ix.ObjectEntry]]:
    live = []
    for t in entries:
        if t.rtype != fmt.RECORD_OBJECT:
            continue
        raw = txn.get(t.oid, db=index.objects)
        if raw is None:
            continue
        e = index.entry(t.oid, raw)
        if e.pack == n and e.offset == t.offset:
            live.append((t.oid, e))
    return live


def collect(store: PackStoreState, *, threshold: float, progress: ProgressFn | None
            ) -> StoreGCReport:
    index = store.index
    damaged = index.trees_problem()
    if damaged is not None:
        raise GCRefused(f"index {index.path} cannot be trusted: {damaged}; nothing was "
                        "collected (repair rebuilds the index from the packs)")
    started = time.time()  # before any pack of this gc was uploaded
    before = store.storage.sizes()
    log = store.log
    base = log.seq(store)
    live = mark(index)
    crashpoints.hit("gc.after_mark")
    swept: list[bytes] = []
    log.begin_gc(store)
    freed_objects = sweep(index, live, swept)
    crashpoints.hit("gc.after_sweep_commit")
    if progress:
        progress(1, 3)

    # Packs of a distributed put in flight (a live lease, engine/store/lease.py): unlisted until
    # its commit adopts them, so neither dropped, rewritten nor deleted as leftovers.
    held = leased(store.path)
    plan = plan_packs(store, threshold, set(live.values()), held)
    if plan.chain and not chain_holds(store, plan.chain, plan.roots):
        # The chain the index names (no checksum) does not replay to its roots: damage.
        # Keeping its packs' records would keep the wrong ones; a fresh full snapshot
        # below replaces them.
        plan.chain, plan.chain_only = set(), set()
    unreadable: list[Problem] = []
    out = PackSet(store.storage, plan.next_pack, store.options.pack_target_size)
    published = keep_uploaded = False
    # Dropping any record of the current roots chain (full snapshot + deltas) would leave
    # repair without it: a fresh full snapshot restarts the chain. Packs rewritten have
    # their chain records copied instead; dropped ones are not even read.
    fresh = bool(set(plan.drop) & plan.chain) or (
        not plan.chain and (plan.seq > 0 or bool(plan.roots)))
    try:
        copied = _copy_live(store, plan, out, unreadable, copy_chain=not fresh)
        moves = copied.moves
        # Packs live objects are in after the moves: never dropped nor deleted, whatever
        # the (unchecksummed) packs table says.
        in_use = {moves[o].pack if o in moves else n for o, n in live.items()}
        gone = (set(plan.rewrite) | set(plan.drop)) - in_use
        seq, snap, chain = plan.seq, plan.snapshot_pack, None
        if not fresh and copied.chain:  # the chain is whole, some of it in new packs
            chain = ix.chain_value((plan.chain - gone) | copied.chain, *plan.chain_bytes)
            if copied.snapshot_pack is not None:
                snap = copied.snapshot_pack
        if fresh:
            seq += 1
            payload = fmt.encode_snapshot(seq, plan.roots)
            sid = fmt.snapshot_id(payload)
            record = fmt.encode_record(fmt.RECORD_ROOTS, 0, (), payload, sid, cctx=None)
            snap, _ = out.append(record, fmt.RECORD_ROOTS, sid, meta=True)
            chain = ix.chain_value([snap], 0, len(payload))
            gone |= plan.chain_only - in_use  # the old chain is superseded
        out.seal_and_sync()
        crashpoints.hit("gc.after_compact_write")
        remote_seq = None
        if gone or out.files or swept:
            log.check_age(started)
            keep_uploaded = log.publishes  # its document may exist from here (writer.commit)
            try:
                remote_seq = _publish(store, base, moves, gone, out, swept)
            except CommitSequenceTaken:
                keep_uploaded = False
                raise
        if gone or out.files:
            index.write(lambda txn: _apply(txn, index, moves, gone, out, seq, snap, chain,
                                           remote_seq))
        else:  # only swept (or nothing): a cache says so too
            log.settle_gc(store, remote_seq)
        published = True
        crashpoints.hit("gc.after_compact_commit")
    except OSError as exc:
        raise store_error("gc compaction failed", exc) from exc
    finally:
        out.close()
        if not published:  # the old packs stay authoritative
            out.discard(keep_uploaded=keep_uploaded)
    if progress:
        progress(2, 3)

    deleted = log.delete_unlisted(store, in_use | held)
    crashpoints.hit("gc.after_delete")
    if progress:
        progress(3, 3)
    after = sum(store.storage.sizes().values())
    return StoreGCReport(
        objects_live=len(live),
        objects_freed=freed_objects,
        bytes_freed=max(0, sum(before.values()) - after),
        packs_rewritten=len(plan.rewrite),
        packs_deleted=deleted,
        unreadable=tuple(unreadable),
    )


def _publish(store: PackStoreState, base: int, moves: dict[bytes, ix.ObjectEntry],
                    gone: set[int], out: PackSet, swept: list[bytes]) -> int | None:
    """Publish this gc in the store's commit log (a bucket's: a local store has nothing to
    publish before its index transaction); on a lost race the swept cache is rebuilt
    from the bucket (another writer may have reused what this gc swept) and
    CommitSequenceTaken raised: nothing of this gc is visible, no pack was deleted."""
    def doc() -> CommitDoc:
        return CommitDoc(kind="gc", gone=tuple(sorted(gone)), swept=tuple(swept),
                         packs=tuple(pack_doc(pf.number, pf.size, pf.meta,
                                              [(o, m) for o, m in moves.items()
                                               if m.pack == pf.number])
                                     for pf in out.files))

    try:
        return store.log.publish(store, base, doc)
    except BaseException:
        store.log.rebuild(store)
        raise


def _apply(txn: ix.Txn, index: ix.Index, moves: dict[bytes, ix.ObjectEntry],
             gone: set[int], out: PackSet, seq: int, snap: int,
             chain: bytes | None, remote_seq: int | None = None) -> None:
    packs = {}
    for pf in out.files:
        live = [m for m in moves.values() if m.pack == pf.number]
        nbytes = sum(m.length for m in live)
        packs[pf.number] = ix.PackEntry(pf.size, nbytes, nbytes, pf.meta, len(live))
    apply_change(txn, index, IndexChange(objects=moves, packs=packs, gone=gone,
                                         next_pack=out.next_number, remote_seq=remote_seq,
                                         seq=seq, snapshot_pack=snap, chain=chain))

"""Rebuild the index from the pack files alone (docs/FORMAT.md "Recovery and repair").

Every pack is read by its trailer, or record by record when the trailer is missing or
damaged; damaged records are skipped and reported. Roots come from the roots snapshot with
the highest (sequence, pack, offset) whose DAGs are complete, so a snapshot of a commit a
crash cut short can never bring back roots over missing objects. The new index is written
beside the old one (``index.new``), synced, and swapped in by two renames that
``PackStore`` finishes on open should a crash fall between them.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import format as fmt
from . import index as ix
from .api import Problem, RepairReport
from .errors import CorruptObject
from .fileio import fsync_dir, store_error
from .ids import hexid
from .lease import live_ranges
from .options import read_stored
from .pack import list_pack_files, pack_name, read_trailer, scan_records
from .walk import Via, walk

if TYPE_CHECKING:
    from .core import StoreCore


@dataclass
class _Found:
    objects: dict[bytes, ix.ObjectEntry]
    packs: dict[int, ix.PackEntry]
    snapshots: list[tuple[int, int, int, fmt.RootsRecord, int]]  # seq, pack, offset, rec, size
    damaged: list[Problem]


def _scan(store: StoreCore, exclude: Container[int] = ()) -> tuple[_Found, int]:
    found = _Found({}, {}, [], [])
    read_all, trailer_of, files = _pack_reader(store)
    for n in sorted(files):
        if n in exclude:
            continue
        name = pack_name(n)
        try:
            data = read_all(n)
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc
        try:
            meta: bool | None = fmt.PackHeader.unpack(data[: fmt.PACK_HEADER.size],
                                                      pack=name).meta
        except CorruptObject as exc:
            meta = None  # its records may still be intact: scan them all the same
            found.damaged.append(Problem("corrupt-pack", str(exc), pack=name, offset=0))
        try:
            entries = trailer_of(n)
        except CorruptObject as exc:
            entries = None  # unsealed crash leftover or damaged trailer: scan sequentially
            found.damaged.append(Problem("damaged-trailer", str(exc), pack=name,
                                         offset=exc.offset))
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc
        objects = []
        for scanned in scan_records(data, name=name, entries=entries):
            rec = scanned.record
            if rec is None:
                err = scanned.error
                found.damaged.append(Problem("corrupt", str(err), pack=name,
                                             oid=err.oid if err is not None else None,
                                             offset=scanned.offset))
            elif rec.header.rtype in fmt.ROOTS_RECORDS:
                _add_snapshot(found, rec, n, name, scanned.offset)
            else:
                objects.append((scanned.offset, rec))
        if meta is None:  # header lost: only meta packs hold roots snapshots
            meta = any(s[1] == n for s in found.snapshots)
        total = live = count = 0
        for offset, rec in objects:
            h = rec.header
            total += h.length
            if h.oid in found.objects:
                continue  # a copy gc made before a crash: the first one wins
            found.objects[h.oid] = ix.ObjectEntry(n, offset, h.length, h.kind, h.raw_len,
                                                  meta, rec.refs)
            live += h.length
            count += 1
        found.packs[n] = ix.PackEntry(len(data), total, live, meta, count)
    return found, max(files, default=-1) + 1


def _pack_reader(store: StoreCore) -> tuple[Callable[[int], bytes],
                                            Callable[[int], list[fmt.TrailerEntry]], list[int]]:
    """(read a whole pack, read its trailer, every pack number) for the store's packs: its
    own directory's files, or those of its bucket / shared directory."""
    if store.remote is None:
        paths = list_pack_files(store.path)
        return ((lambda n: paths[n].read_bytes()),
                (lambda n: read_trailer(paths[n], name=pack_name(n))), list(paths))
    storage = store.storage
    try:
        numbers = list(storage.sizes())
    except OSError as exc:
        raise store_error(f"cannot list the packs of {storage.describe()}", exc) from exc
    return storage.read_all, storage.read_trailer, numbers


def _add_snapshot(found: _Found, rec: fmt.Record, n: int, name: str, offset: int) -> None:
    try:
        roots = fmt.decode_roots_record(rec.payload, rec.header.rtype, pack=name, offset=offset)
    except CorruptObject as exc:
        found.damaged.append(Problem("corrupt", str(exc), pack=name, offset=offset))
        return
    found.snapshots.append((roots.seq, n, offset, roots, len(rec.payload)))


def _complete(objects: dict[bytes, ix.ObjectEntry], roots: dict[str, bytes]) -> bool:
    """Whether every object the roots reach was found in the packs."""

    def refs_of(oid: bytes, via: Via) -> tuple[bytes, ...] | None:
        entry = objects.get(oid)
        if entry is None:
            raise _Incomplete
        return entry.refs

    try:
        walk(((oid, name) for name, oid in roots.items()), refs_of)
    except _Incomplete:
        return False
    return True


class _Incomplete(Exception):
    """Stops ``_complete``'s walk at the first missing object."""


@dataclass
class _Roots:
    max_seq: int = 0
    newest_pack: int = -1
    roots: dict[str, bytes] = field(default_factory=dict)
    chain: list[int] = field(default_factory=list)  # [] demands a full snapshot next
    delta_bytes: int = 0
    full_bytes: int = 0


def _choose_roots(found: _Found) -> _Roots:
    """Replay the newest full snapshot and the deltas after it.

    Of records sharing a sequence (a dead writer's and the next commit's) the one with the
    highest (pack, offset) wins. A name whose DAG is incomplete falls back to its newest
    older target whose DAG is complete (reported as "root-rolled-back"), or is dropped
    ("dangling-root"); other roots are never held back by one damaged root. A gap in the
    delta chain is reported ("roots-gap") and the later deltas still apply."""
    by_seq: dict[int, tuple] = {}
    for snap in found.snapshots:
        if snap[0] not in by_seq or snap[1:3] > by_seq[snap[0]][1:3]:
            by_seq[snap[0]] = snap
    ordered = [by_seq[k] for k in sorted(by_seq)]
    if not ordered:
        return _Roots()
    out = _Roots(max_seq=ordered[-1][0], newest_pack=ordered[-1][1])
    history: dict[str, list[bytes]] = {}  # every target each name had, oldest first
    for _, _, _, rec, _ in ordered:
        for name, oid in rec.roots.items():
            history.setdefault(name, []).append(oid)
    start = max((i for i, s in enumerate(ordered) if s[3].full), default=None)
    state: dict[str, bytes] = {}
    regular = start is not None
    prev = ordered[start][0] - 1 if start is not None else None
    for seq, n, offset, rec, size in ordered[start or 0:]:
        if prev is not None and seq != prev + 1:
            regular = False
            found.damaged.append(Problem(
                "roots-gap", f"roots records {prev + 1}..{seq - 1} are missing or damaged; "
                "later ones applied regardless", pack=pack_name(n), offset=offset))
        prev = seq
        state = rec.apply(state)
        out.chain.append(n)
        out.delta_bytes += 0 if rec.full else size
        out.full_bytes = size if rec.full else out.full_bytes
    newest_offset = ordered[-1][2]
    for name, oid in sorted(state.items()):
        if _complete(found.objects, {name: oid}):
            out.roots[name] = oid
            continue
        regular = False
        older = next((o for o in reversed(history.get(name, [])) if o != oid
                      and _complete(found.objects, {name: o})), None)
        if older is not None:
            out.roots[name] = older
            what, tail = "root-rolled-back", f"restored to its older target {hexid(older)}"
        else:
            what, tail = "dangling-root", "dropped"
        found.damaged.append(Problem(
            what, f"root {name!r} -> {hexid(oid)} reaches missing objects; {tail}",
            oid=oid, pack=pack_name(out.newest_pack), offset=newest_offset))
    if not regular:  # the packs' chain does not say what the index now holds
        out.chain, out.delta_bytes = [], 0
    return out


def rebuild(store: StoreCore, *, from_packs: bool = False, exclude: Container[int] = (),
            extra_meta: Mapping[bytes, bytes] | None = None) -> RepairReport:
    """Called by ``PackStore.repair`` with the writer lock held.

    The new index is written into a fresh environment beside the old one, which is never
    trusted nor written (it may be the damage being repaired), and swapped in; other
    processes notice the swap (``Index.refresh_if_replaced``) before their next writer,
    gc or repair and within a second on reads. A bucket or shared-directory store rebuilds
    from its commit documents (engine/storage/remote.py), which calls back here with
    ``from_packs`` when they are damaged: packs in ``exclude`` are skipped, and
    ``extra_meta`` is written into the new index with the rest."""
    if store.remote is not None and not from_packs:
        return store.remote.rebuild(store)
    found, next_pack = _scan(store, exclude)
    chosen = _choose_roots(found)
    seq, snap_pack, roots = chosen.max_seq, chosen.newest_pack, chosen.roots
    old = store.index
    try:
        old_next = old.read(lambda t: ix.get_u64(t, old.meta, ix.META_NEXT_PACK))
        old_seq = old.read(lambda t: ix.get_u64(t, old.meta, ix.META_SEQ))
    except Exception:  # the old index may be the damaged thing we are replacing
        old_next = old_seq = 0
    meta = {
        ix.META_VERSION: ix.U64.pack(fmt.FORMAT_VERSION),
        # Past live leases too: their ranks may not have created every reserved pack yet.
        ix.META_NEXT_PACK: ix.U64.pack(max(next_pack, old_next, *(
            r.stop for r in live_ranges(store.path, clean=False)))),
        ix.META_SEQ: ix.U64.pack(max(seq, old_seq)),
        ix.META_SNAPSHOT_PACK: ix.I64.pack(snap_pack),
        ix.META_CHAIN: ix.chain_value(chosen.chain, chosen.delta_bytes, chosen.full_bytes),
        ix.META_ENTRY_SUMS: ix.U64.pack(1),
        ix.META_ROOTS_SUM: ix.roots_digest(roots),
        **(extra_meta or {}),
    }

    def fill(index: ix.Index, txn: Any, *, drop: bool) -> None:
        if drop:
            for db in (index.objects, index.packs, index.roots):
                txn.drop(db, delete=False)
        for oid, entry in found.objects.items():
            txn.put(oid, entry.encode(oid), db=index.objects)
        for n, packed in found.packs.items():
            txn.put(ix.pack_key(n), packed.encode(), db=index.packs)
        for name, oid in roots.items():
            txn.put(name.encode("utf-8"), oid, db=index.roots)
        for key, value in meta.items():
            txn.put(key, value, db=index.meta)

    # Always into a fresh environment: the old one may be the damaged thing (a flipped
    # page pointer or a short map can SIGBUS the process that writes into it).
    rebuild_beside(store, lambda new, txn: fill(new, txn, drop=False))
    store.index.legacy_entries = False
    store.readers.close()
    return RepairReport(len(found.packs), len(found.objects), len(roots),
                        tuple(found.damaged))


def rebuild_beside(store: StoreCore, fill: Callable[[ix.Index, Any], None]) -> None:
    """Fill a fresh environment ``index.new`` and swap it in for the store's index."""
    old = store.index
    new_path = store.path / "index.new"
    if new_path.exists():
        shutil.rmtree(new_path)
    try:
        map_size = old.map_size
    except Exception:  # a damaged environment may not even report its size
        map_size = 1 << 30
    try:  # the store's recorded options outlive the rebuild when they can still be read
        options = read_stored(old) or store.options.persisted()
    except Exception:
        options = store.options.persisted()
    new = ix.Index(new_path, map_size=map_size, create=True, options=options)
    try:
        new.write(lambda txn: fill(new, txn))
        new.sync()
    finally:
        new.close()
    old.replace_files(lambda: _swap(store.path))


def _swap(p: pathlib.Path) -> None:
    """index.new -> index, keeping the old one as index.old until the swap is durable
    (PackStore finishes an interrupted swap on open)."""
    try:
        if (p / "index.old").exists():
            shutil.rmtree(p / "index.old")
        if (p / "index").exists():
            os.replace(p / "index", p / "index.old")
        fsync_dir(p)
        os.replace(p / "index.new", p / "index")
        fsync_dir(p)
        shutil.rmtree(p / "index.old", ignore_errors=True)
    except OSError as exc:
        raise store_error("cannot swap in the rebuilt index", exc) from exc

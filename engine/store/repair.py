"""Rebuild the index from the pack files alone (docs/FORMAT.md "Recovery and repair").

Every pack is read by its trailer, or record by record when the trailer is missing or
damaged; damaged records are skipped and reported (pack, offset, id). Which roots are kept
and where they point is engine/store/repairroots.py: never is a root dropped whose DAG still
partly reads. ``plan_at`` and ``rebuild(dry_run=True)`` stop after the plan. The new index
is written beside the old one (``index.new``), synced, and swapped in by two renames that
``PackStore`` finishes on open should a crash fall between them.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import lmdb
import xxhash

from ..api import Object, Problem, RepairReport
from ..errors import CorruptObject, FormatError, NotSupported
from ..format import records as fmt
from ..format import trailer
from ..format.ids import ID_SIZE
from ..fs.fileio import fsync_dir, store_error
from ..index import db as ix
from ..index.options import read_stored
from ..packs.pack import list_pack_files, pack_name, read_trailer, scan_records
from ..packs.storage import PackStorage
from .lease import live_ranges
from .repairroots import ChosenRoots, Snapshot, choose_roots

if TYPE_CHECKING:
    from .core import PackStoreState


@dataclass
class _Found:
    objects: dict[bytes, ix.ObjectEntry]
    packs: dict[int, ix.PackEntry]
    snapshots: list[Snapshot]
    damaged: list[Problem]


def _scan(source: _Source, exclude: Container[int] = ()) -> tuple[_Found, int]:
    found = _Found({}, {}, [], [])
    files = source.numbers()
    for n in files:
        if n in exclude:
            continue
        name = pack_name(n)
        try:
            data = source.read_all(n)
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc
        try:
            meta: bool | None = fmt.PackHeader.unpack(data[: fmt.PACK_HEADER.size],
                                                      pack=name).meta
        except CorruptObject as exc:
            meta = None  # its records may still be intact: scan them all the same
            found.damaged.append(Problem("corrupt-pack", str(exc), pack=name, offset=0))
        try:
            entries = source.trailer(n)
        except CorruptObject as exc:
            entries = None  # unsealed crash leftover or damaged trailer: scan sequentially
            found.damaged.append(Problem("damaged-trailer", str(exc), pack=name,
                                         offset=exc.offset))
        except OSError as exc:
            raise store_error(f"cannot read pack {name}", exc) from exc
        objects = []
        listed = {e.offset: e.oid for e in entries or ()}  # ids even of damaged records
        for scanned in scan_records(data, name=name, entries=entries):
            rec = scanned.record
            if rec is None and (rec := _salvage(data, scanned.offset, name)) is not None:
                found.damaged.append(Problem(
                    "bad-checksum", f"pack {name} offset {scanned.offset}: the record's "
                    "checksum field is damaged but its content hashes to its id; indexed",
                    pack=name, oid=rec.header.oid, offset=scanned.offset))
            if rec is None:
                err = scanned.error
                oid = err.oid if err is not None and err.oid else listed.get(scanned.offset)
                found.damaged.append(Problem(
                    "corrupt", f"{err}; record skipped, not indexed", pack=name, oid=oid,
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


class _Source:
    """Where a repair reads packs: the files of a store directory (or of a shared
    directory's packs/), or a bucket's objects through its PackStorage."""

    def __init__(self, where: pathlib.Path | PackStorage) -> None:
        self._storage = where if isinstance(where, PackStorage) else None
        self._files = list_pack_files(where) if isinstance(where, pathlib.Path) else {}

    def numbers(self) -> list[int]:
        if self._storage is None:
            return sorted(self._files)
        try:
            return sorted(self._storage.sizes())
        except OSError as exc:
            raise store_error(f"cannot list the packs of {self._storage.describe()}",
                              exc) from exc

    def read_all(self, n: int) -> bytes:
        if self._storage is None:
            return self._files[n].read_bytes()
        return self._storage.read_all(n)

    def trailer(self, n: int) -> list[trailer.TrailerEntry]:
        if self._storage is None:
            return read_trailer(self._files[n], name=pack_name(n))
        return self._storage.read_trailer(n)

    def read(self, n: int, offset: int, length: int) -> bytes:
        if self._storage is None:
            with open(self._files[n], "rb") as f:
                f.seek(offset)
                return f.read(length)
        return self._storage.read(n, offset, length)


def _salvage(data: bytes, offset: int, name: str) -> fmt.Record | None:
    """The record at ``offset`` if only its checksum field is damaged: everything else it
    holds is proven by its id (readers that re-hash the id read it the same way)."""
    try:
        h = fmt.RecordHeader.unpack(data, offset, pack=name)
        if offset + h.length > len(data):
            return None
        raw = bytearray(data[offset:offset + h.length])
        body = memoryview(raw)[:-fmt.CHECKSUM.size]
        fmt.CHECKSUM.pack_into(raw, len(raw) - fmt.CHECKSUM.size,
                               xxhash.xxh3_64_intdigest(body))
        body.release()
        return fmt.decode_record(bytes(raw), 0, pack=name)
    except CorruptObject:
        return None


def _add_snapshot(found: _Found, rec: fmt.Record, n: int, name: str, offset: int) -> None:
    try:
        roots = fmt.decode_roots_record(rec.payload, rec.header.rtype, pack=name, offset=offset)
    except CorruptObject as exc:
        found.damaged.append(Problem("corrupt", str(exc), pack=name, offset=offset))
        return
    found.snapshots.append((roots.seq, n, offset, roots, len(rec.payload)))


@dataclass(frozen=True)
class _OldMeta:
    """What the index being replaced still says. ``seq`` is None when it cannot say which
    commits were published (damaged, or empty: a lost index, rebuilt at open); ``roots``
    None unless they pass their checksum."""

    next_pack: int = 0
    seq: int | None = None
    roots: dict[str, bytes] | None = None
    packs: frozenset[int] = frozenset()  # the packs it lists


def _read_old(txn: Any, meta: Any, packs: Any, roots_db: Any) -> _OldMeta:
    try:
        nxt = ix.get_next_pack(txn, meta)
    except ix.DamagedIndex:  # past the pack numbers: the packs say better
        nxt = 0
    if not txn.stat(packs)["entries"]:
        return _OldMeta(nxt)
    seq = ix.get_u64(txn, meta, ix.META_SEQ)
    listed = frozenset(ix.unpack_pack_key(bytes(k)) for k, _ in txn.cursor(db=packs))
    raw = {bytes(k): bytes(v) for k, v in txn.cursor(db=roots_db)}
    stored = txn.get(ix.META_ROOTS_SUM, db=meta)
    roots = None
    if stored is not None and ix.roots_digest(raw) == bytes(stored) and all(
            len(v) == ID_SIZE for v in raw.values()):
        try:
            roots = {k.decode("utf-8"): v for k, v in raw.items()}
        except UnicodeDecodeError:
            roots = None
    return _OldMeta(nxt, seq, roots, listed)


def _old_meta(index: ix.Index) -> _OldMeta:
    try:
        return index.read(lambda t: _read_old(t, index.meta, index.packs, index.roots))
    except Exception:  # the old index may be the damaged thing we are replacing
        return _OldMeta()


def _old_meta_at(path: pathlib.Path) -> _OldMeta:
    """``_old_meta`` of the index of a store not open, read without writing a byte (no
    lock file: a dry run changes nothing) and only when plain reads find it sound."""
    data = path / "index" / "data.mdb"
    if not data.exists() or ix.data_file_problem(data, all_trees=True) is not None:
        return _OldMeta()
    try:
        env = lmdb.open(os.fspath(path / "index"), readonly=True, lock=False, subdir=True,
                        max_dbs=4, readahead=False, map_size=max(data.stat().st_size, 1))
    except Exception:
        return _OldMeta()
    try:
        with env.begin() as t:
            dbs = (env.open_db(name, txn=t) for name in (ix.DB_META, ix.DB_PACKS, ix.DB_ROOTS))
            return _read_old(t, *dbs)
    except Exception:
        return _OldMeta()
    finally:
        env.close()


@dataclass
class _Plan:
    found: _Found
    next_pack: int
    chosen: ChosenRoots
    old: _OldMeta

    def report(self, *, dry_run: bool) -> RepairReport:
        return RepairReport(len(self.found.packs), len(self.found.objects),
                            len(self.chosen.roots), tuple(self.found.damaged),
                            dry_run=dry_run, roots=tuple(self.chosen.repairs))


def _plan(where: pathlib.Path | PackStorage, old: _OldMeta,
          exclude: Container[int] = ()) -> _Plan:
    source = _Source(where)
    found, next_pack = _scan(source, exclude)
    for n in sorted(old.packs - found.packs.keys()):
        found.damaged.append(Problem(
            "missing-pack", f"pack {pack_name(n)} is listed by the index but its file is "
            "gone: the objects it held are lost", pack=pack_name(n)))
    chosen = choose_roots(found.snapshots, found.objects, found.damaged, old.seq, old.roots)
    for i, r in enumerate(chosen.repairs):  # the layer above names what a root lost
        if r.action == "damaged":
            chosen.repairs[i] = replace(r, node=_read_found(source, found.objects[r.oid],
                                                            r.oid))
    return _Plan(found, next_pack, chosen, old)


def _read_found(source: _Source, entry: ix.ObjectEntry, oid: bytes) -> Object | None:
    try:
        raw = source.read(entry.pack, entry.offset, entry.length)
        rec = fmt.decode_record(raw, 0, pack=pack_name(entry.pack))
    except (OSError, KeyError, CorruptObject):
        return None
    return Object(rec.header.kind, rec.refs, rec.payload) if rec.header.oid == oid else None


def plan_at(path: str | os.PathLike) -> RepairReport:
    """What ``repair`` of the store at ``path`` would do, without opening its index for
    writing or writing anything (``cnrstore repair --dry-run``)."""
    p = pathlib.Path(path).absolute()
    if not (p / "packs").is_dir():
        raise FormatError(f"no store at {p} (it has no packs/ directory)")
    return _plan(p, _old_meta_at(p)).report(dry_run=True)


def rebuild(store: PackStoreState, *, dry_run: bool = False, from_packs: bool = False,
            exclude: Container[int] = (),
            extra_meta: Mapping[bytes, bytes] | None = None) -> RepairReport:
    """Called by ``PackStore.repair`` with the writer lock held.

    The new index is written into a fresh environment beside the old one, which is never
    trusted nor written (it may be the damage being repaired), and swapped in; other
    processes notice the swap (``Index.refresh_if_replaced``) before their next writer,
    gc or repair and within a second on reads. A bucket or shared-directory store rebuilds
    from its commit documents (engine/store/commit/bucket.py), which calls back here with
    ``from_packs`` when they are damaged: its packs are read through its storage, those in
    ``exclude`` skipped, and ``extra_meta`` written into the new index with the rest."""
    if store.log.publishes and not from_packs:  # the commit documents are the truth
        if dry_run:
            raise NotSupported("repair(dry_run=True) of a bucket or shared-directory store: "
                               "its index cache rebuilds from the commit documents")
        return store.log.rebuild(store)
    plan = _plan(store.storage if from_packs else store.path, _old_meta(store.index),
                 exclude)
    if dry_run:
        return plan.report(dry_run=True)
    found, next_pack, chosen = plan.found, plan.next_pack, plan.chosen
    seq, snap_pack, roots = chosen.max_seq, chosen.newest_pack, chosen.roots
    old_next, old_seq = plan.old.next_pack, plan.old.seq or 0
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
    return plan.report(dry_run=False)


def rebuild_beside(store: PackStoreState, fill: Callable[[ix.Index, Any], None]) -> None:
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

"""Is the index up to date with its packs? (docs/FORMAT.md "Index freshness").

The index is derived data and can fall behind the packs it describes: ``data.mdb`` deleted
or truncated (LMDB then starts an empty one), an index restored from an older backup, or a
crash between a commit's pack fsync and its index transaction. Trusting such an index is
how gc deletes live packs: every pack it does not list looks like a crash leftover.

The index knows the commit it reflects (``meta.commit_seq``); the packs know the newest
commit: every root-changing commit and every gc snapshot writes a roots record carrying
its sequence into a fresh meta pack. Packs the index lists were published with a sequence
at most the index's own, so the newest sequence on disk is found in the packs the index
does NOT list, and only in sealed ones (a commit seals before it publishes). That is
cheap on a healthy store: one directory listing, and no pack is read unless a crash left
one behind. A head file alone would not do: it can be as stale as the index it sits by.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import time
from typing import TYPE_CHECKING, Any

from ..api import Problem, RepairReport
from ..errors import CorruptObject, FormatError, StaleIndex, StoreLocked
from ..format import records as fmt
from ..fs.fileio import fsync_dir
from ..index import db as ix
from ..packs.pack import list_pack_files, pack_name, pack_numbers, read_trailer
from .repair import rebuild

if TYPE_CHECKING:
    from .core import PackStoreState


def settle_index_swap(p: pathlib.Path) -> None:
    """With the writer lock held: finish or undo a repair's index swap a crash interrupted
    (docs/FORMAT.md "Recovery and repair")."""
    if not (p / "index").exists() and (p / "index.new").exists():
        if (p / "index.old").exists():
            os.replace(p / "index.new", p / "index")  # index.new was complete and synced
            fsync_dir(p)
        else:
            shutil.rmtree(p / "index.new")  # repair died while writing it
    if (p / "index").exists():
        for leftover in ("index.new", "index.old"):
            if (p / leftover).exists():
                shutil.rmtree(p / leftover)


_CATCH_UP_WAIT_S = 60.0  # how long an opener waits for the writer lock to rebuild


def open_index(store: PackStoreState) -> RepairReport | None:
    """Open ``store``'s index, rebuilding it from the packs (under the writer lock) when it
    is missing, damaged (never handed to LMDB: a truncated map kills with SIGBUS) or
    behind its packs. Read-only handles refuse such an index (StaleIndex) instead.
    Returns the report of the rebuild open had to do, if any; closes what it opened when
    it raises."""
    if store.readonly:
        try:
            _open_readonly(store)
        except ix.UnknownIndexVersion as exc:
            _refuse_newer(store, exc)
            raise StaleIndex(f"store {store.path}: {exc}; every pack is of version "
                             f"{fmt.FORMAT_VERSION}: open the store writable to rebuild "
                             "the index from them") from None
        except ix.DamagedIndex as exc:
            _refuse_newer(store, exc)
            raise
        return None
    try:
        return _open_writable(store, damaged=False)
    except ix.UnknownIndexVersion as exc:
        # A bit flip (1 -> 17) made a healthy store unopenable; a newer cnrstore's store
        # shows in its packs. The index is derived data: rebuilt from packs we read.
        _refuse_newer(store, exc)
        why = f"{exc}; every pack is of version {fmt.FORMAT_VERSION}: index rebuilt from them"
        return _reported(_open_writable(store, damaged=True), why)
    except ix.DamagedIndex as exc:
        # LMDB itself found pages it cannot use, or the meta values fail their checksum:
        # derived data, rebuilt from the packs (unless they are a newer cnrstore's, which
        # this code would take for damaged records).
        _refuse_newer(store, exc)
        return _reported(_open_writable(store, damaged=True), f"{exc}: index rebuilt")


def _refuse_newer(store: PackStoreState, exc: FormatError) -> None:
    """Raise FormatError (upgrade cnrstore) when a pack of ``store`` is of a newer format
    version than this code reads: then the index is a newer cnrstore's, not damaged, and
    must not be rebuilt by this code (it would take the newer records for damage)."""
    for n, path in sorted(list_pack_files(store.path).items()):
        try:
            with open(path, "rb") as f:
                head = f.read(fmt.PACK_HEADER.size)
        except OSError:
            continue  # unreadable: proves nothing either way
        if head[:4] == fmt.PACK_MAGIC and len(head) > 4 and head[4] > fmt.FORMAT_VERSION:
            raise FormatError(f"{exc}, and pack {pack_name(n)} has format version "
                              f"{head[4]}: upgrade cnrstore to open this store") from None


def _reported(report: RepairReport | None, why: str) -> RepairReport:
    """``report`` of an open's rebuild, saying why the old index was dropped (a bucket
    cache rebuilds from its commits later, in attach: then no pack was scanned here)."""
    problem = Problem("damaged-index", why)
    if report is None:
        return RepairReport(0, 0, 0, (problem,))
    return dataclasses.replace(report, damaged=(problem, *report.damaged))


def _open_writable(store: PackStoreState, *, damaged: bool, unsafe: bool = False
                   ) -> RepairReport | None:
    """Open the index writable. Its file is walked once (engine/index/lmdbcheck.py), by
    the open itself; a file found ``unsafe`` is opened again under the writer lock, which
    walks it once more and, still unsafe, replaces it by a rebuild from the packs."""
    p = store.path
    lock = store.lock
    report = None
    data = p / "index" / "data.mdb"
    locked = False
    try:
        if damaged or unsafe or not data.exists():
            lock.acquire(None)  # a repair elsewhere may be between its renames
            locked = True
        elif (p / "index.new").exists() or (p / "index.old").exists():
            try:
                lock.acquire(0.0)
                locked = True
            except StoreLocked:
                pass  # a repair is running: its leftovers are its own
        if locked:
            settle_index_swap(p)
            if (p / "index").exists() and (damaged or not data.exists()
                                           or ix.data_file_problem(data) is not None):
                # Derived data we must not map: rebuilt from the packs below.
                shutil.rmtree(p / "index")
                fsync_dir(p)
        needs_repair = not (p / "index").exists() and bool(list_pack_files(p))
        try:
            index = ix.open_shared(p / "index", map_size=store.options.map_size,
                                   options=store.options.persisted())
        except ix.UnsafeIndexFile:
            if locked:
                raise  # sound under the lock a moment ago: open_index rebuilds it
            index = None
        if index is not None:
            store.attach(index)
            try:
                if needs_repair:
                    report = _rebuild(store)
                else:
                    report = _bring_up_to_date(store, locked)
            except BaseException:
                store.close_files()
                raise
    finally:
        if locked:
            lock.release()
    if index is None:
        return _open_writable(store, damaged=False, unsafe=True)
    return report


def _rebuild(store: PackStoreState) -> RepairReport:
    return rebuild(store)


def _bring_up_to_date(store: PackStoreState, locked: bool) -> RepairReport | None:
    problem = stale_problem(store)
    if problem is None and not store.index.legacy_entries and not _legacy_meta(store):
        return None
    if not locked:
        deadline = time.monotonic() + _CATCH_UP_WAIT_S
        while True:
            try:
                store.lock.acquire(0.05 if problem else 0.0)
                break
            except StoreLocked:
                if problem is None:
                    return None  # entries get their checksums at a later open
                # A commit between its pack fsync and its index transaction looks just
                # like this: once it lands, the index is up to date after all.
                problem = stale_problem(store)
                if problem is None:
                    return None
                if time.monotonic() > deadline:
                    raise StaleIndex(f"store {store.path}: {problem}; the writer lock "
                                     "stayed taken, so it could not be rebuilt") from None
    report = None
    try:
        store.index.refresh_if_replaced()
        if stale_problem(store) is not None:
            report = _rebuild(store)
        try:
            store.index.upgrade_entries()
        except CorruptObject:
            # An entry that fails its checksum (or its length): the index is damaged, not
            # merely old (an upgrade is one transaction, so a true legacy index has no
            # checksummed entry to fail). Raising here left a store that could not even be
            # opened to repair it; rebuild from the packs, as for a stale index.
            report = _rebuild(store)
        if _legacy_meta(store):  # an index from before the meta checksum (its version
            # was checked at open): checksummed from now on
            index = store.index
            index.write(lambda t: ix.put_meta_checksum(t, index.meta))
    finally:
        if not locked:
            store.lock.release()
    return report


def _legacy_meta(store: PackStoreState) -> bool:
    index = store.index
    return index.read(lambda t: t.get(ix.META_META_SUM, db=index.meta) is None)


def _open_readonly(store: PackStoreState) -> None:
    p = store.path
    data = p / "index" / "data.mdb"
    if not data.exists():
        raise StaleIndex(f"store {p} has no index; open it writable once to rebuild it "
                         "from the packs")
    try:
        index = ix.open_shared(p / "index", map_size=store.options.map_size,
                               options=store.options.persisted(), readonly=True)
    except ix.UnsafeIndexFile as exc:  # the open's one walk of the file found it unsafe
        raise StaleIndex(f"store {p}: {exc.problem}; open it writable to rebuild the "
                         "index") from None
    store.attach(index)
    try:
        problem = stale_problem(store)
    except BaseException:
        store.close_files()
        raise
    if problem is not None:
        store.close_files()
        raise StaleIndex(f"store {p}: {problem}; open it writable to bring the index up "
                         "to date")


def stale_problem(store: PackStoreState, *, full: bool = True) -> str | None:
    """Why the index must not be trusted (behind its packs, empty beside sealed packs, or
    roots failing their checksum), or None. Reads no pack on a healthy store.

    ``full=False`` (before each writer, the index already checked at open) looks only at
    the run of pack files from ``next_pack`` on: a writer or gc that died after sealing
    left its packs there, numbered consecutively from the ``next_pack`` it read."""
    index = store.index
    if not full:
        next_pack, seq = index.read(lambda t: (ix.get_next_pack(t, index.meta),
                                               ix.get_u64(t, index.meta, ix.META_SEQ)))
        n = next_pack
        while (store.path / "packs" / pack_name(n)).exists():
            newest = _newest_seq(store, n)
            if newest is not None and newest > seq:
                return (f"pack {pack_name(n)} holds commit {newest}, the index only "
                        f"reaches commit {seq} (a commit or gc that died after sealing)")
            n += 1
        return None

    def state(txn: Any) -> tuple[set[int], int, str | None]:
        listed = {ix.unpack_pack_key(k) for k in txn.cursor(db=index.packs).iternext(values=False)}
        return listed, ix.get_u64(txn, index.meta, ix.META_SEQ), ix.roots_problem(txn, index)

    listed, seq, roots_problem = index.read(state)
    if roots_problem is not None:
        return roots_problem
    unlisted = sorted(pack_numbers(store.path) - listed, reverse=True)
    for n in unlisted:
        newest = _newest_seq(store, n)
        if newest is None:
            continue  # unsealed or damaged: a crash leftover, never a published pack
        if not listed and newest >= 0:
            # Only a pack with a roots record proves a lost index: a sealed pack without
            # one is a rank's pack of a distributed put that never committed (or data no
            # root reached), which gc reclaims.
            return (f"the index lists no pack but sealed pack {pack_name(n)} exists "
                    "(index emptied or lost)")
        if newest > seq:
            return (f"pack {pack_name(n)} holds commit {newest}, the index only reaches "
                    f"commit {seq} (an older or damaged index)")
    return None


def _newest_seq(store: PackStoreState, n: int) -> int | None:
    """Highest roots-record sequence in sealed pack ``n`` (-1: sealed, none there), or
    None when the pack is not sealed or cannot be read."""
    path = store.path / "packs" / pack_name(n)
    try:
        entries = read_trailer(path, name=pack_name(n))
    except (CorruptObject, OSError):
        return None
    newest = -1
    roots = [e for e in entries if e.rtype in fmt.ROOTS_RECORDS]
    if not roots:
        return newest
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        for e in roots:
            data = os.pread(fd, e.length, e.offset)
            try:
                rec = fmt.decode_record(data, 0, pack=pack_name(n))
                seq = fmt.decode_roots_record(rec.payload, rec.header.rtype, pack=pack_name(n)).seq
            except CorruptObject:
                continue
            newest = max(newest, seq)
    except OSError:
        return None
    finally:
        os.close(fd)
    return newest

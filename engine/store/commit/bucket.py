"""Commits of a bucket store: create-only commit objects, and the local index as their
cache (docs/FORMAT.md "Object stores").

Every commit (a writer's or a gc's) is one document at ``commits/<seq:020d>``
(engine/format/commitdoc.py: checksummed msgpack), created with If-None-Match after all
its packs are uploaded: the object that makes it visible. Two writers that read the same
newest commit both try ``seq + 1``: exactly one creates it, the other catches up and gets
RootExists (it lost a create_root race) or CommitSequenceTaken. The document carries the
index entries of the packs it adds, so a cache catches up (or an empty one rebuilds) from
commit documents alone, never reading a pack.

A document that is missing, too big or damaged never stops a cache: it is rebuilt from
the packs themselves (they are self-describing, engine/store/repair.py), the damage recorded in
the cache and reported, and gc refuses to delete anything until the documents read
whole again. A gc deletes the packs it retires only ``gc_grace_s`` after its commit (a
later gc does), so readers still holding old locations keep reading; one that finds a
pack gone catches up and looks again. Only the process that holds a cache lists the
bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import msgpack

from ...api import Problem, RepairReport
from ...errors import (
    CommitSequenceTaken,
    CorruptObject,
    FormatError,
    GCRefused,
    NoStore,
    RootExists,
    StoreError,
    StoreLocked,
)
from ...format.commitdoc import CommitDoc, commit_key, decode_commit, encode_commit
from ...index import db as ix
from ...index.commits import (
    META_REMOTE_DAMAGED,
    META_REMOTE_DIRTY,
    META_REMOTE_ID,
    META_REMOTE_SEQ,
    META_RETIRED,
    apply_commit,
    meta_get,
    record_seq,
)
from ..repair import rebuild, rebuild_beside
from ..unlisted import delete_unlisted, listed_packs
from . import chain
from .chain import ChainDamaged
from .gcproof import check_chain, still_needed

if TYPE_CHECKING:
    from ...packs.storage import PackStorage
    from ..core import PackStoreState

_REFRESH_WAIT_S = 5.0


class Remote:
    """The commit protocol of one bucket store, for one cache: its ``CommitLog``
    (``PackStoreState.log``; engine/store/core.py)."""

    publishes = True

    def __init__(self, storage: PackStorage, *, staging: pathlib.Path,
                 gc_grace_s: float) -> None:
        self.storage = storage
        self.objects = storage.backend  # commit documents and claims: keys and bytes
        self.staging = staging
        self.url = storage.describe()
        self.gc_grace_s = float(gc_grace_s)
        self.last_rebuild: RepairReport | None = None  # a catch-up that met damage

    def damage(self, core: PackStoreState) -> list[str]:
        """Why the cache was rebuilt from the packs ([] when the commit documents said
        everything it holds)."""
        index = core.index
        raw = index.read(lambda t: meta_get(t, index, META_REMOTE_DAMAGED))
        return [] if raw is None else [str(m) for m in msgpack.unpackb(raw)]

    def seq(self, core: PackStoreState) -> int:
        index = core.index
        return index.read(lambda t: ix.get_u64(t, index.meta, META_REMOTE_SEQ))

    # -- open and catch up ----------------------------------------------------------------
    def attach(self, core: PackStoreState, *, create: bool) -> RepairReport | None:
        """At open, under the writer lock: check that the cache belongs to this bucket
        location, rebuild it after an interrupted gc, and bring it up to date."""
        index = core.index
        location = self.url.encode("utf-8")
        report = None
        with self._locked(core, None):
            self.staging.mkdir(exist_ok=True)
            for leftover in self.staging.iterdir():  # a dead writer's: claims kept
                leftover.unlink()

            def state(t: ix.Txn) -> tuple[bytes | None, bool, int]:
                return (meta_get(t, index, META_REMOTE_ID), meta_get(t, index, META_REMOTE_DIRTY)
                        is not None, t.stat(index.objects)["entries"])

            owner, dirty, nobj = index.read(state)
            if owner is None and nobj:
                raise FormatError(f"cache {core.path} holds a store that is not a cache of "
                                  f"{self.url}")
            if owner is not None and owner != location:
                raise FormatError(f"cache {core.path} belongs to {owner.decode()!r}, not "
                                  f"{self.url}")
            if owner is None:
                index.write(lambda t: t.put(META_REMOTE_ID, location, db=index.meta))
            damaged = bool(self.damage(core)) and not dirty
            found = chain.survey(self.objects) if damaged else None
            if dirty or (found is not None and not found.problems):
                report = self.rebuild(core)  # a mended chain is read again
            else:
                # Still damaged: the packs were indexed already; newer commits apply.
                self.catch_up(core)
                report, self.last_rebuild = self.last_rebuild, None
                if report is None and found is not None:
                    report = self._counts(core, tuple(found.problems))
            if not create and self.seq(core) == 0:
                raise NoStore(f"no store at {self.url} (pass create=True to "
                                  "make one)")
        return report

    @contextlib.contextmanager
    def _locked(self, core: PackStoreState, timeout: float | None) -> Iterator[None]:
        core.lock.acquire(timeout)
        try:
            yield
        finally:
            core.lock.release()

    def catch_up(self, core: PackStoreState) -> int:
        """With the writer lock held: apply every commit newer than the cache's, in one
        transaction; return how many. A damaged one rebuilds the cache from the packs
        (``last_rebuild`` reports it)."""
        index = core.index
        applied = 0

        def apply(txn: ix.Txn) -> None:
            nonlocal applied
            for doc in chain.documents(self.objects, ix.get_u64(txn, index.meta,
                                                                META_REMOTE_SEQ)):
                apply_commit(txn, index, doc)
                applied += 1

        try:
            index.write(apply)
        except ChainDamaged as exc:
            self.last_rebuild = self._rebuild_from_packs(core, exc)
            return 0
        return applied

    def refresh(self, core: PackStoreState) -> None:
        """A reader found a pack gone: catch up if the writer lock can be had soon (a
        writer of this handle holds it for its whole life: then the read just retries).
        A cache rebuilt from the packs is rebuilt again: its locations may name a pack
        that a gc it could not read retired."""
        if core.readonly or core.lock.held:
            return
        try:
            with self._locked(core, _REFRESH_WAIT_S):
                if self.damage(core):
                    self.rebuild(core)
                else:
                    self.catch_up(core)
        except StoreLocked:
            pass

    def rebuild(self, core: PackStoreState) -> RepairReport:
        """With the writer lock held: a fresh cache from every commit document, or from
        the packs when one is damaged."""
        location = self.url.encode("utf-8")

        def fill(new: ix.Index, txn: ix.Txn) -> None:
            for key in (ix.META_SEQ, ix.META_NEXT_PACK):
                txn.put(key, ix.U64.pack(0), db=new.meta)
            txn.put(ix.META_SNAPSHOT_PACK, ix.I64.pack(-1), db=new.meta)
            txn.put(ix.META_CHAIN, ix.chain_value([], 0, 0), db=new.meta)
            txn.put(ix.META_ROOTS_SUM, ix.roots_digest({}), db=new.meta)
            txn.put(META_REMOTE_ID, location, db=new.meta)
            for doc in chain.documents(self.objects, 0):
                apply_commit(txn, new, doc)

        try:
            rebuild_beside(core, fill)
        except ChainDamaged as exc:
            return self._rebuild_from_packs(core, exc)
        return self._counts(core, ())

    @staticmethod
    def _counts(core: PackStoreState, damaged: tuple[Problem, ...]) -> RepairReport:
        index = core.index
        counts = index.read(lambda t: (t.stat(index.packs)["entries"],
                                       t.stat(index.objects)["entries"],
                                       t.stat(index.roots)["entries"]))
        return RepairReport(*counts, damaged)

    def _rebuild_from_packs(self, core: PackStoreState, exc: ChainDamaged) -> RepairReport:
        """The commit documents cannot say what the store holds: index every pack
        (engine/store/repair.py), less those a readable document retired, at the newest commit
        number listed (a writer of this cache commits after it), and record the damage
        (gc refuses while it lasts; an open rereads the documents)."""
        found = chain.survey(self.objects)
        problems = found.problems or [Problem("damaged-commit", str(exc), pack=exc.key)]
        messages = [p.message for p in problems]
        extra = {META_REMOTE_ID: self.url.encode("utf-8"),
                 META_REMOTE_SEQ: ix.U64.pack(found.newest),
                 META_REMOTE_DAMAGED: msgpack.packb(messages)}
        report = rebuild(core, from_packs=True, exclude=found.gone, extra_meta=extra)
        index = core.index

        def at_least(t: ix.Txn) -> None:
            if ix.get_u64(t, index.meta, ix.META_SEQ) < found.newest:
                t.put(ix.META_SEQ, ix.U64.pack(found.newest), db=index.meta)

        index.write(at_least)
        return dataclasses.replace(report, damaged=(*problems, *report.damaged))

    # -- publishing -----------------------------------------------------------------------
    def publish(self, core: PackStoreState, base: int, doc: Callable[[], CommitDoc]) -> int:
        """Create commit ``base + 1``, the document ``doc()`` (all its packs uploaded). On
        a lost race the cache catches up and RootExists (a name this commit creates now
        exists) or CommitSequenceTaken is raised; nothing of this commit is then visible
        anywhere."""
        seq = base + 1
        # The token tells our own document from another writer's: a create whose
        # response was lost is retried by the client and then answered 412 by itself.
        token = os.urandom(16)
        made = dataclasses.replace(doc(), seq=seq, time=time.time(), token=token)
        try:
            self.objects.put_if_absent(commit_key(seq), encode_commit(made))
        except FileExistsError:
            if self._is_ours(seq, token):
                return seq
            self.catch_up(core)
            index = core.index
            names = [n.encode("utf-8") for n in made.creates]
            taken = index.read(lambda t: [n for n in names
                                          if t.get(n, db=index.roots) is not None])
            for name in (n.decode() for n in taken):
                    raise RootExists(f"root {name!r} already exists: another writer "
                                     f"committed it first ({self.url})",
                                     name=name) from None
            raise CommitSequenceTaken(f"{self.url}: another writer committed {seq} "
                                   "first; nothing of this commit was published") from None
        return seq

    def check_age(self, started: float) -> None:
        """Refuse to commit packs a gc elsewhere may already have deleted as a dead
        writer's: those uploaded more than ``gc_grace_s`` ago (less a tenth for clock
        skew). Nothing was published; the packs are deleted. ``gc_grace_s`` 0 (tests)
        accepts the risk."""
        age = time.time() - started
        if self.gc_grace_s > 0 and age > 0.9 * self.gc_grace_s:
            raise StoreError(f"{self.url}: this commit's packs are {age:.0f} s old, "
                             f"too close to gc_grace_s ({self.gc_grace_s:.0f} s): a gc may "
                             "have deleted them; nothing was published (raise gc_grace_s)")

    def _is_ours(self, seq: int, token: bytes) -> bool:
        key = commit_key(seq)
        try:
            return decode_commit(self.objects.get(key), key).token == token
        except (FileNotFoundError, CorruptObject):
            return False  # ours would be whole

    def begin_gc(self, core: PackStoreState) -> None:
        """Before gc sweeps the cache: should it die before its commit is published, the
        next open rebuilds the cache instead of trusting a sweep the bucket never saw."""
        check_chain(self.storage, self.damage(core), core)
        index = core.index
        index.write(lambda t: t.put(META_REMOTE_DIRTY, b"1", db=index.meta))

    def settle_gc(self, core: PackStoreState, seq: int | None) -> None:
        """A gc that moved no pack: record its commit (if it swept anything) and clear
        the dirty mark."""
        index = core.index

        def settle(t: ix.Txn) -> None:
            if seq is not None:
                record_seq(t, index, seq)
            t.delete(META_REMOTE_DIRTY, db=index.meta)

        index.write(settle)

    def delete_unlisted(self, core: PackStoreState, live_packs: set[int]) -> int:
        """Delete pack objects the index no longer lists once no reader may need them:
        ``gc_grace_s`` after the commit that retired them, or after their upload for
        packs no commit ever listed (crash leftovers; a writer still uploading is
        younger than that)."""
        index = core.index

        def state(t: ix.Txn) -> tuple[set[int], dict]:
            return listed_packs(t, index), msgpack.unpackb(
                meta_get(t, index, META_RETIRED) or b"\x80", strict_map_key=False)

        listed, retired = index.read(state)
        now = time.time()
        present = self.storage.listing()
        kept = []

        def keep(n: int) -> bool:
            if now - retired.get(n, present[n].modified) < self.gc_grace_s:
                return True
            why = still_needed(self.storage, core, n, present)
            if why is not None:
                kept.append(f"pack {n}: {why}")
            return why is not None

        deleted = delete_unlisted(core, live_packs, present, listed=listed, keep=keep)
        for n in deleted:
            retired.pop(n, None)
        index.write(lambda t: t.put(META_RETIRED, msgpack.packb(retired), db=index.meta))
        if kept:
            raise GCRefused(f"gc on {self.url} kept {len(kept)} packs the index no "
                            f"longer lists but still needs ({kept[0]}); its commit stands, "
                            "nothing of them was deleted: verify, then repair")
        return len(deleted)

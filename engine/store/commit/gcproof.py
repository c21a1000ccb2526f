"""What gc proves before a bucket or shared-directory store loses anything
(docs/FORMAT.md "Object stores", gc): the commit chain reads whole and agrees with the
cache, and an unlisted pack's own trailer shows nothing the index still needs."""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from ...errors import CorruptObject, GCRefused
from ...format import records as fmt
from ...format.ids import hexid
from ...index import db as ix
from ...index.commits import META_REMOTE_SEQ
from . import chain

if TYPE_CHECKING:
    from ...packs.storage import PackStorage
    from ..core import PackStoreState


def check_chain(storage: PackStorage, damage: list[str], core: PackStoreState) -> None:
    """gc deletes only what it can prove dead: refuse (GCRefused, nothing changed)
    when a commit document is damaged (``damage``: why the cache was rebuilt from the
    packs), or the cache and the documents disagree on the newest commit or on the packs
    that hold the store."""
    where = storage.describe()
    if damage:
        raise GCRefused(f"gc refused on {where}: this cache was rebuilt from the packs "
                        f"because {damage[0]}; put the document back (or repair once "
                        "it is) and gc again")
    index = core.index

    def view(t: ix.Txn) -> tuple[int, set[int]]:
        keys = t.cursor(db=index.packs).iternext(values=False)
        return (ix.get_u64(t, index.meta, META_REMOTE_SEQ),
                {ix.unpack_pack_key(k) for k in keys})

    seq, packs = index.read(view)
    # Up to the cache's commit: one another writer made since is this gc's lost race
    # (CommitSequenceTaken at its publish), not a disagreement.
    found = chain.survey(storage.backend, upto=seq)
    if found.problems:
        raise GCRefused(f"gc refused on {where}: {found.problems[0].message} "
                        f"({len(found.problems)} problems); nothing was deleted")
    if seq != found.newest or packs != found.packs:
        odd = sorted(packs ^ found.packs)[:5]
        raise GCRefused(f"gc refused on {where}: the cache (commit {seq}) and the commit "
                        f"documents (commit {found.newest}) disagree on the store's "
                        f"packs (e.g. {odd}); nothing was deleted: open a fresh cache "
                        "or repair")


def still_needed(storage: PackStorage, core: PackStoreState, n: int,
                  present: Container[int]) -> str | None:
    """Why unlisted pack ``n`` must stay, by its own trailer: an object in it is indexed
    there, or indexed in a pack that is not there or does not hold it at that offset (a
    damaged commit document named the wrong pack). None when every object in it is dead
    or held whole elsewhere, or it has no trailer (never sealed, so never committed)."""
    try:
        entries = storage.read_trailer(n)
    except (CorruptObject, FileNotFoundError):
        return None
    oids = [e.oid for e in entries if e.rtype == fmt.RECORD_OBJECT]
    index = core.index

    def look(t: ix.Txn) -> list[tuple[bytes, bytes]]:
        out = []
        for oid in oids:
            raw = t.get(oid, db=index.objects)
            if raw is not None:
                out.append((oid, bytes(raw)))
        return out

    held: dict[int, set[tuple[bytes, int]]] = {}
    for oid, raw in index.read(look):
        try:
            e = index.entry(oid, raw)
        except CorruptObject:
            return f"the index entry of {hexid(oid)} is damaged"
        if e.pack == n:
            return f"object {hexid(oid)} is indexed in it"
        if e.pack not in present:
            return f"object {hexid(oid)} is indexed in pack {e.pack}, which is not there"
        if e.pack not in held:
            try:
                held[e.pack] = {(t.oid, t.offset) for t in storage.read_trailer(e.pack)}
            except (CorruptObject, FileNotFoundError):
                held[e.pack] = set()
        if (oid, e.offset) not in held[e.pack]:
            return f"object {hexid(oid)} is indexed in pack {e.pack}, which does not hold it"
    return None


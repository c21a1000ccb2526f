"""The coordinator's side of a distributed put, on an open store's ``PackStoreState``
(docs/FORMAT.md "Distributed commit"): reserve pack numbers for the ranks, tell them
which objects the store lacks, and where the objects they must read lie.
``PackStore.reserve_packs`` / ``locate`` / ``locate_closure`` / ``missing`` call these.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..format.ids import check_id
from ..format.location import RecordLocation
from ..index import db as ix
from ..packs.pack import pack_numbers
from .lease import Leases
from .walk import Via, walk

if TYPE_CHECKING:
    from .core import PackStoreState

MAX_RESERVE = 1 << 20


def reserve(core: PackStoreState, leases: Leases, n: int) -> range:
    """With the writer lock held: lease and durably reserve ``n`` pack numbers.

    The range starts above ``next_pack`` and above every pack file on disk (a dead
    writer's leftovers sit at ``next_pack`` and after), and ``next_pack`` moves past it in
    one index transaction, so no later writer, gc or repair ever creates those numbers;
    the lease (engine/store/lease.py) keeps gc from deleting the ranks' packs until the put
    commits, fails, or its process dies."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_RESERVE:
        raise ValueError(f"n must be an int in 0..{MAX_RESERVE}, got {n!r}")
    index = core.index
    start = index.read(lambda t: ix.get_next_pack(t, index.meta))
    start = max(start, max(pack_numbers(core.path), default=-1) + 1)
    packs = range(start, start + n)
    if not n:
        return packs
    leases.take(packs)  # before the reservation commits: a crash between leaves a stale file

    def advance(txn: ix.Txn) -> None:
        current = ix.get_next_pack(txn, index.meta)
        txn.put(ix.META_NEXT_PACK, ix.U64.pack(max(current, packs.stop)), db=index.meta)

    try:
        index.write(advance)
    except BaseException:
        leases.release(packs)
        raise
    return packs


def _location(index: ix.Index, oid: bytes, raw: bytes) -> RecordLocation:
    e = index.entry(oid, raw)
    return RecordLocation(oid, e.kind, e.refs, e.pack, e.offset, e.length, e.raw_len, e.meta)


def _ids(oids: Iterable[bytes]) -> list[bytes]:
    out = []
    for oid in oids:
        check_id(oid)
        out.append(bytes(oid))
    return out


def locate(core: PackStoreState, oids: Iterable[bytes]) -> dict[bytes, RecordLocation]:
    """Locations of those ``oids`` the index holds (one read transaction)."""
    wanted = _ids(oids)
    index = core.index

    def read(txn: ix.Txn) -> dict[bytes, RecordLocation]:
        found = {}
        for oid in wanted:
            raw = txn.get(oid, db=index.objects)
            if raw is not None:
                found[oid] = _location(index, oid, raw)
        return found

    return index.read(read)


def locate_closure(core: PackStoreState, oids: Iterable[bytes]) -> dict[bytes, RecordLocation]:
    """Locations of ``oids`` and of everything they reach by refs (one read transaction):
    what a rank needs to read a block and its patch chain, or a manifest subtree. Ids
    the index lacks are absent (reading them then raises ObjectNotFound); an entry that
    fails its checksum raises CorruptObject."""
    starts = [(oid, "located") for oid in _ids(oids)]
    index = core.index

    def read(txn: ix.Txn) -> dict[bytes, RecordLocation]:
        found: dict[bytes, RecordLocation] = {}

        def refs_of(oid: bytes, via: Via) -> tuple[bytes, ...] | None:
            raw = txn.get(oid, db=index.objects)
            if raw is None:
                return None
            loc = _location(index, oid, raw)  # CorruptObject when the entry is damaged
            found[oid] = loc
            return loc.refs

        walk(starts, refs_of)
        return found

    return index.read(read)


def missing(core: PackStoreState, oids: Iterable[bytes]) -> set[bytes]:
    """Those ``oids`` the index does not hold (one read transaction)."""
    wanted = _ids(oids)
    index = core.index
    return index.read(lambda t: {o for o in wanted if t.get(o, db=index.objects) is None})

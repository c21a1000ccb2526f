"""Restore reads a few blocks at a time, each file's records in file order.

A block of the latest step is a full block in an old pack plus one patch in each newer
step's pack. Read block by block, the disk hopped between four files at every block
(each patch a request of its own), and the read-ahead hints that kept the disk busy split
the reads further: a cold exact restore of 532 MB issued 550-1000 requests of 0.5-1 MB
where a front-to-back read of the same bytes issues ~165 of 3 MB, and the decode threads
spent ~1 s of a 1.8 s restore inside the hints (docs/design/read-speed.md, "Cold exact:
the order of the reads"). Here a window of consecutive blocks (across the tables of one
restore) is located in one index read, its patches read in (pack, offset) order, then its
full blocks in order, straight into the output, each block's patches applied while it is
in cache. No hints: each file is read forwards, which the kernel's own read-ahead follows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cnrstore.core.blockread import Located
from cnrstore.errors import CheckpointError, ManifestError
from cnrstore.format.blocks import KIND_BLOCK_LIST, KIND_BLOCK_PATCH, plan_chain
from cnrstore.format.manifest import TableManifest
from cnrstore.format.rowlists import read_list
from engine import Object, ObjectStore, StoreClosed, StoreError

__all__ = ["WINDOW_BYTES", "Block", "can_locate", "read_windows", "windows"]

WINDOW_BYTES = 32 << 20  # output bytes per window: a few blocks, two windows in flight

# one block of a restore: (decode block i given its window's locations, i, table)
Block = tuple[Callable[[int, Located | None], None], int, TableManifest]


def windows(blocks: Sequence[Block], limit: int | None = None) -> list[list[Block]]:
    """``blocks`` (in read order) cut into runs of at most ``limit`` stored bytes (at
    least one block each): the patches of a window are held until its blocks are read."""
    limit = WINDOW_BYTES if limit is None else limit
    out: list[list[Block]] = []
    size = 0
    for b in blocks:
        start, stop = b[2].node.block_range(b[1])
        nbytes = (stop - start) * b[2].node.row_nbytes
        if not out or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(b)
        size += nbytes
    return out


def can_locate(objects: ObjectStore) -> bool:
    """Whether ``objects`` gives record locations (a pack store; not the memory twin or a
    rank's located view)."""
    try:
        objects.locate_closure([])
    except StoreClosed:
        raise
    except StoreError:
        return False
    return True


def read_windows(objects: ObjectStore, window: list[Block]) -> None:
    """Decode every block of ``window``, its patches read first in file order."""
    oids = [tm.block_ids[i] for _, i, tm in window]
    located: Located | None = None
    try:
        found = objects.locate_closure(oids)
    except StoreClosed:
        raise
    except StoreError:  # no locations here: each block reads as before
        found = None
    if found is not None:
        located = (found, _patches(objects, found, window))
    for one, i, _ in window:
        one(i, located)


def _listed(objects: ObjectStore, found: dict[bytes, Any], oid: bytes) -> tuple[bytes, ...]:
    """The objects list node ``oid`` reads: its refs, or a delta's base and the entries it
    keeps (both nodes read here, small), not the dropped objects its closure holds."""
    refs = tuple(found[oid].refs)
    if not refs or found[refs[0]].kind != KIND_BLOCK_LIST:
        return refs
    nodes: dict[bytes, Object] = {}

    def get(ref: bytes) -> Object:
        if ref not in nodes:
            nodes[ref] = objects.get_at(found[ref])
        return nodes[ref]

    try:
        return (refs[0], *read_list(get, oid).refs)
    except StoreClosed:
        raise
    except (StoreError, CheckpointError):
        return refs[:1]  # the block's own read reports it


def _patches(objects: ObjectStore, found: dict[bytes, Any], window: list[Block]
             ) -> dict[bytes, Object]:
    """The patch records of ``window``'s chains, read in (pack, offset) order. Only the
    chains whose sizes the index shows in bounds (``plan_chain``, as every block read
    checks before reading); a chain refused, or a record that fails its checks, is left to
    the block's own read, which reports it naming the table and block."""
    locs = {}
    lists = False
    for _, i, tm in window:
        node = tm.node
        start, stop = node.block_range(i)
        oid = tm.block_ids[i]
        try:
            plan_chain(found.__getitem__, oid, stop - start, node.row_nbytes)
        except (ManifestError, KeyError):  # refused or unlocated: the block's read says why
            continue
        while True:
            loc = found[oid]
            if loc.kind == KIND_BLOCK_LIST:  # a list and its row objects, all read here
                lists = True
                locs[oid] = loc
                for ref in _listed(objects, found, oid):
                    locs[ref] = found[ref]
                break
            if loc.kind != KIND_BLOCK_PATCH:
                break
            locs[oid] = loc
            oid = loc.refs[0]
    todo = sorted(locs.values(), key=lambda c: (c.pack, c.offset))
    try:  # the records close together in a pack with one read each (a list's ~350).
        # A list's objects lie in ~150 packs (one a step): read one after another, a cold
        # read waited on each in turn; hinted first, the disk reads them together.
        # A list's row objects are read through memoryviews (format/rowapply.py): kept
        # as views of the span reads, not copied out of them.
        read = objects.get_many_at(todo, hint=lists, views=lists)
        return {loc.oid: obj for loc, obj in zip(todo, read)}
    except StoreClosed:
        raise
    except StoreError:
        pass  # one record fails: read the others alone, as below
    got: dict[bytes, Object] = {}
    for loc in todo:
        try:
            got[loc.oid] = objects.get_at(loc)
        except StoreClosed:
            raise
        except StoreError:
            continue  # read again (and reported) by the block's own read
    return got

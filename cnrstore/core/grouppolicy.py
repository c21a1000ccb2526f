"""The grouped layout's write policy: a block version is a list of row objects, each
holding rows of one change-rate class, and a cleaner that keeps a version's read near
1.5x the block (docs/design/diff-base.md, "Rows grouped by rate"; benches/model_longrun.py
``piece_policy`` is the reference replay).

The writer's state of a block version (``ListedVersion``) is its listed objects and, per row,
which of them holds the row's newest copy and a u8 code stored with the copy. A block
written whole since 2026-12-07 has its step (``born``) in its lists, and a row's code is
its count of changes since then (halved every COUNT_EPOCH steps, capped at COUNT_CAP): its
rate at a step is that count over the steps seen plus COUNT_PRIOR. A block of an older
store, whose lists have no ``born``, keeps the design's exponential average until it is
next written whole: the code a rate (``rate_code``) decayed by (1 - ALPHA) per step since
the write, plus ALPHA at a step that changes it. Everything is a function of the stored
list, so a handle reopened on the store (``load_group``) decides exactly as one that never
closed, and ids are the same at any world size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cnrstore.core.blockplan import GROUPED, BlockWrite, block_cuts
from cnrstore.core.tablestate import BlockSlot, TableState
from cnrstore.errors import CheckpointError, ManifestError
from cnrstore.format.rowlists import (
    KIND_BLOCK_LIST,
    decode_rows_object,
    rate_code,
    rate_value,
    read_list,
    rows_nbytes,
)
from engine import Object, StoreError

__all__ = ["ALPHA", "COUNT_PRIOR", "COUNT_EPOCH", "COUNT_CAP", "THRESHOLDS", "HYSTERESIS",
           "READ_TARGET", "OVERSHOOT", "CHUNK_ROWS", "DELTA_SHARE", "Piece", "ListBase",
           "ListedVersion", "GroupWrite", "fresh_group", "next_group", "load_group",
           "group_of", "grouped_writes"]

# A row's class is the interval of THRESHOLDS its rate lies in; in a block whose lists
# have no born step (an older store's) the rate is an exponential average of "changed
# this step" with weight ALPHA until the block is next written whole. Nine classes at
# 0.01 (the design's setting A was four at 0.02: 0.04, 0.1, 0.3): the longer average and
# the finer classes tell apart the rows a Zipf step changes once in 25-400 steps, so
# fewer of them share an object with rows changed far less often; with the grouped
# layout's 131072-row blocks (core/options.py GROUPED_BLOCK_ROWS) int8 wrote 1.559x ->
# 1.508x at 5% changed rows and 1.614x -> 1.455x at 1% in the replay
# (docs/design/grouped-layout.md, "Larger blocks, longer rates, more classes").
ALPHA = 0.01
# A row's rate as a count of changes n over the steps w since its block was written whole:
# n / (w + COUNT_PRIOR). Every change since counts alike, where the average above weighs
# the last ~100 steps and so tells a row changed once in 100 steps from one changed once
# in 25 by little more than when it last changed; COUNT_PRIOR (a prior of no change over
# that many steps) keeps the first few changes from lifting a row far. The count is the
# code (held as a log rate code, rounding wrote 1.499-1.518x at 5% int8), and a class's
# rows hold a few distinct counts, narrower packed codes than rates. In the replay
# (docs/design/grouped-layout.md, "Rate estimators"), with version-3 objects and the
# nearest stop, int8 writes 1.479x at 5% changed rows (1.496x with rates), 1.424x at 1%
# (1.449x); exact 1.426x (1.437x) and 1.297x (1.326x).
# Halving every COUNT_EPOCH steps keeps the window finite (a long run's rates can drift)
# and the count within a u8; the bench's runs (<= 300 steps) never halve.
COUNT_PRIOR = 400.0
COUNT_EPOCH = 512
COUNT_CAP = 254
THRESHOLDS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.07, 0.15, 0.3)
HYSTERESIS = 0.5                  # a row leaves a class only below half its threshold
# A version's listed payload is cleaned back to this share of the block's bytes. The
# estimate counts each row's id and rate, so the records, list nodes and index entries
# stay within it: a restore read 1.486-1.494x on the bench at 1.49 (1.466-1.474x at 1.47,
# which wrote 0.02-0.04x more; docs/design/diff-base.md, "As built").
READ_TARGET = 1.49
# The cleaner stops at the object nearest READ_TARGET, at most this share of the block
# past it: at 131072-row blocks the objects it drops are ~1% of the block, so this never
# binds there; the read then lands on both sides of the target, 1.494-1.496x at most in
# the replay (docs/design/grouped-layout.md, "Entropy-coded ids and rates").
OVERSHOOT = 0.005
CHUNK_ROWS = 2048                 # rows of each object of a block written fresh
_CLASSES = len(THRESHOLDS) + 1
# A version's list is written as a delta of the block's last full list (rowlists.py)
# until its entries (added and dropped) pass this share of the base's: written whole at
# every step, the list node cost 0.1x of the changed bytes at 1% changed rows. On the
# bench 0.5 writes least (1% exact 1.784x; 1.785x at 0.25, 1.795x at 0.12 and 1.0); 0.25
# keeps a smaller closure (dropped objects a base names: 1.54-1.59x, 1.64-1.69x at 0.5).
DELTA_SHARE = 0.5


class Piece:
    """One listed row object: its id (None until the writer writes it), class, step, row
    count and payload bytes. Shared by every version that lists it."""

    __slots__ = ("oid", "cls", "step", "count", "nbytes")

    def __init__(self, oid: bytes | None, cls: int, step: int, count: int, nbytes: int):
        self.oid, self.cls, self.step, self.count, self.nbytes = oid, cls, step, count, nbytes


@dataclass(frozen=True)
class ListBase:
    """The block's last full list node: its id, refs and listed bytes (what a delta of
    it counts against)."""

    oid: bytes
    refs: tuple[bytes, ...]
    nbytes: int


@dataclass
class ListedVersion:
    """A block version: ``pieces`` in list order, ``owner[r]`` the position of the piece
    holding row r's newest copy, ``rq[r]`` row r's rate code at that write; ``base`` the
    full list a delta of it would name (None: none written yet). ``after``: the version
    this one was planned on, until this one is written; its base is taken then
    (``settle_base``), since writing that version may set a new one."""

    pieces: list[Piece]
    owner: np.ndarray   # int32[nrows]
    rq: np.ndarray      # uint8[nrows]
    base: ListBase | None = None
    after: ListedVersion | None = None
    born: int | None = None   # rq holds counts since this step (None: rates, rate_code)

    def settle_base(self) -> None:
        """Before this version is written (the writer writes versions in put order): the
        base its predecessor left. Taken when planned instead, a put planned while the one
        before it was still queued named an older base: other ids, by timing."""
        if self.after is not None:
            self.base, self.after = self.after.base, None


# (piece, positions of its rows among the written rows or None for a span, span start,
# rate codes or None)
NewPiece = tuple[Piece, "np.ndarray | None", int, "np.ndarray | None"]


@dataclass(frozen=True)
class GroupWrite:
    """What a put writes of one block: the new pieces, each with the positions of its rows
    among the block's written rows (None: the span of a fresh chunk, ``start``), and the
    rows' rate codes (None: a fresh chunk's, all zero)."""

    group: ListedVersion
    new: list[NewPiece]
    rows: np.ndarray | None   # block-local ids written, ascending (None: every row)


def fresh_group(nrows: int, row_nbytes: int, step: int) -> GroupWrite:
    """A block written whole: chunk objects of CHUNK_ROWS rows (no ids, no rates), so no
    cleaning ever copies more than one chunk's rows at once."""
    new: list[NewPiece] = []
    for start in range(0, nrows, CHUNK_ROWS):
        count = min(CHUNK_ROWS, nrows - start)
        piece = Piece(None, 0, step, count,
                      rows_nbytes(nrows, count, row_nbytes, span=True, rated=False))
        new.append((piece, None, start, None))
    owner = (np.arange(nrows, dtype=np.int64) // CHUNK_ROWS).astype(np.int32)
    group = ListedVersion([p for p, *_ in new], owner, np.full(nrows, 255, dtype=np.uint8),
                          born=step)
    return GroupWrite(group, new, None)


def counted_rates(rq: np.ndarray, written: np.ndarray, changed: np.ndarray, step: int,
                  born: int) -> tuple[np.ndarray, np.ndarray]:
    """(rate, count code) of each row at ``step`` of a block born at ``born``: ``rq`` the
    rows' counts when last written (255: none yet, a chunk's), at steps ``written``,
    halved at every COUNT_EPOCH boundary since, plus one where ``changed``."""
    epoch = max(step - born, 0) // COUNT_EPOCH
    halvings = epoch - np.maximum(written - born, 0) // COUNT_EPOCH
    n = np.where(rq == 255, 0, rq).astype(np.int64) >> np.clip(halvings, 0, 62)
    n[changed] = np.minimum(n[changed] + 1, COUNT_CAP)
    # the steps a count stands for: this epoch's, and half of each before (as halved)
    seen = max(step - born, 0) - epoch * COUNT_EPOCH + COUNT_EPOCH * (1.0 - 0.5 ** epoch)
    return n / (seen + COUNT_PRIOR), n.astype(np.uint8)


def _classes(old: ListedVersion, pstep: np.ndarray, pcls: np.ndarray, changed: np.ndarray,
             step: int) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``rows -> (u8 code, class at step)`` of ascending block rows: a changed row's code
    counts this step's change, each row's class moves to its rate's interval (with
    HYSTERESIS going down). A block with counts computes them for the rows asked only (the
    writer asks for the changed rows, then those it writes: ~1% of a block, where the
    whole block's took most of a put's policy time); the elementwise integer and IEEE
    division steps give each row what the whole block's arrays give it. An older block's
    average (powers, logarithms) is computed over the whole block, as it always was."""
    owner = old.owner
    th = np.asarray(THRESHOLDS)

    def classes(rate: np.ndarray, cur: np.ndarray) -> np.ndarray:
        up = np.searchsorted(th, rate, side="right")
        down = np.searchsorted(th * HYSTERESIS, rate, side="right")
        return np.where(up > cur, up, np.where(down < cur, down, cur))

    if old.born is None:
        own = owner.astype(np.int64)
        rate = rate_value(old.rq) * (1.0 - ALPHA) ** (step - pstep[own]).astype(np.float64)
        rate[changed] += ALPHA
        target = classes(rate, pcls[own])
        return lambda rows: (rate_code(rate[rows]), target[rows])
    born = old.born
    flag = np.zeros(len(owner), dtype=bool)
    flag[changed] = True

    def of(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        own = owner[rows]
        rate, counts = counted_rates(old.rq[rows], pstep[own], flag[rows], step, born)
        return counts, classes(rate, pcls[own])
    return of


def next_group(old: ListedVersion, changed: np.ndarray, step: int, row_nbytes: int) -> GroupWrite:
    """The version after rows ``changed`` (block-local, ascending) changed at ``step``:
    the changed rows go to their class's object; if the version would then read more
    than READ_TARGET of the block, the objects of most (stale bytes / live rows) x age
    are cleaned (their newest rows written again into this step's class objects) until
    it would not."""
    nrows = len(old.owner)
    pieces = old.pieces
    npieces = len(pieces)
    pstep = np.array([p.step for p in pieces], dtype=np.int64)
    pcls = np.array([p.cls for p in pieces], dtype=np.int64)
    pbytes = np.array([p.nbytes for p in pieces], dtype=np.float64)
    owner = old.owner
    of = _classes(old, pstep, pcls, changed, step)
    live = np.bincount(owner, minlength=npieces)
    live_after = live - np.bincount(owner[changed], minlength=npieces)
    keep = live_after > 0
    # A copied row's bytes: its codes, its id and rate code (Elias-Fano or Rice, packed
    # or Huffman: at most ~2 bytes in objects of 1/64 of a block and more: rowobjects.py)
    per_row = row_nbytes + 2
    ccodes, ccls = of(changed)
    sizes = {k: rows_nbytes(nrows, int((ccls == k).sum()), row_nbytes,
                            rates=ccodes[ccls == k], index=changed[ccls == k])
             for k in range(_CLASSES) if (ccls == k).any()}
    est = float(pbytes[keep].sum()) + sum(sizes.values())
    target = READ_TARGET * nrows * row_nbytes
    gone = np.zeros(npieces, dtype=bool)
    if est > target:
        freed = np.where(keep, pbytes - live_after * per_row - 36.0, 0.0)
        stale = np.where(keep, pbytes - live_after * row_nbytes, 0.0)
        gain = stale / np.maximum(live_after, 1) * (step - pstep + 1)
        order = np.argsort(-np.where(keep, gain, -np.inf), kind="stable")
        cum = np.cumsum(freed[order])
        need = int(np.searchsorted(cum, est - target)) + 1
        # Stop at the object that leaves the version nearest the target, not at the first
        # past it: cleaned versions then land on both sides of it instead of below it by
        # half an object (0.0037x of the block at 5% changed rows, where objects are
        # large), read budget that would otherwise go to copies. Never past it by more
        # than OVERSHOOT: a small block's objects (a fresh chunk is a whole 2048-row
        # block) would take a read far past it.
        if 1 < need <= len(cum):
            over = est - cum[need - 2] - target
            if over < min(target - est + cum[need - 1], OVERSHOOT * nrows * row_nbytes):
                need -= 1
        gone[order[:need]] = True
        gone &= keep
    cleaned = bool(gone.any())
    if cleaned:
        mask = gone[owner]
        mask[changed] = True
        rows = np.flatnonzero(mask)
        codes, dest = of(rows)
    else:  # the changed rows alone, as estimated
        rows, codes, dest = changed.astype(np.int64, copy=False), ccodes, ccls

    kept = np.flatnonzero(keep & ~gone)
    remap = np.full(npieces, -1, dtype=np.int64)
    remap[kept] = np.arange(len(kept))
    new_owner = remap[owner]
    listed = [pieces[j] for j in kept]
    new_rq = old.rq.copy()
    new_rq[rows] = codes
    new: list[NewPiece] = []
    for k in range(_CLASSES):
        sel = np.flatnonzero(dest == k)
        if not len(sel):
            continue
        nbytes = (rows_nbytes(nrows, len(sel), row_nbytes, rates=codes[sel], index=rows[sel])
                  if cleaned else sizes[k])
        piece = Piece(None, k, step, len(sel), nbytes)
        new_owner[rows[sel]] = len(listed)
        listed.append(piece)
        new.append((piece, sel, 0, codes[sel]))
    assert (new_owner >= 0).all()  # every row keeps one newest copy
    version = ListedVersion(listed, new_owner.astype(np.int32), new_rq, old.base, after=old,
                            born=old.born)
    return GroupWrite(version, new, rows)


def load_group(get: Callable[[bytes], Object], oid: bytes, nrows: int, row_nbytes: int
               ) -> ListedVersion | None:
    """The writer state of stored block version ``oid``, rebuilt from its list (a delta
    through its base) and its objects' row ids and rate codes (None: not a list, e.g. a
    chain of an older layout). ManifestError or the engine's error when a listed object
    cannot be read."""
    node = get(oid)
    if node.kind != KIND_BLOCK_LIST:
        return None
    entries = read_list(get, oid, node)
    refs, cls, counts, steps = entries.refs, entries.cls, entries.rows, entries.steps
    born = entries.born
    owner = np.full(nrows, -1, dtype=np.int32)
    rq = np.full(nrows, 255, dtype=np.uint8)
    pieces = []
    for k, ref in enumerate(refs):
        obj = get(ref)
        head, idx, rates, _ = decode_rows_object(obj, ref, codes=False)
        if (head.nrows, head.row_nbytes, head.count, head.cls, head.step) != (
                nrows, row_nbytes, counts[k], cls[k], steps[k]):
            raise ManifestError(f"row object {ref.hex()} does not match its list entry "
                                "or block", oid=oid)
        at: slice | np.ndarray = slice(head.start, head.start + head.count) if idx is None \
            else idx
        owner[at] = k
        rq[at] = rates
        pieces.append(Piece(ref, head.cls, head.step, head.count, len(obj.payload)))
    if (owner < 0).any():
        raise ManifestError("block list leaves rows with no copy", oid=oid)
    bb = entries.base_nbytes
    base = ListBase(entries.base, entries.base_refs,
                    sum(p.nbytes for p in pieces) if bb is None else bb)
    return ListedVersion(pieces, owner, rq, base, born=born)


def group_of(old: BlockSlot, base: TableState | None, row_nbytes: int
              ) -> tuple[ListedVersion | None, int]:
    """(the grouped writer state of ``old``, 1 if its stored list could not be read):
    loaded from the store the base was seeded from when the handle has none. None: not
    a list (a chain of the other layout) or unreadable; the block is then written fresh."""
    if old.group is not None:
        return old.group, 0
    if base is None or base.reader is None or old.oid is None:
        return None, 0
    try:
        old.group = load_group(base.reader, old.oid, old.nrows, row_nbytes)
    except (StoreError, CheckpointError):
        return None, 1
    return old.group, 0


def grouped_writes(changed: np.ndarray, cbase: TableState | None, rows: int, rnb: int,
                   block_rows: int, step: int
                   ) -> tuple[list[BlockSlot | None], list[BlockWrite], list, int, int]:
    """``blockplan.block_writes`` of the grouped layout (and the blocks whose stored list
    could not be read, written fresh): a changed block's next version, a new block's
    chunks, an unchanged block's slot as it was."""
    nblocks = -(-rows // block_rows)
    counts, cuts = block_cuts(changed, nblocks, block_rows)
    slots: list[BlockSlot | None] = []
    writes: list[BlockWrite] = []
    parts: list = []
    pos = rewritten = 0
    for i in range(nblocks):
        start = i * block_rows
        nr = min(start + block_rows, rows) - start
        old = cbase.slots[i] if cbase is not None and i < len(cbase.slots) else None
        k = int(counts[i]) if counts is not None else 0
        if old is not None and old.nrows == nr and k == 0:
            slots.append(old)
            continue
        gw = None
        if old is not None and old.nrows == nr:
            group, lost = group_of(old, cbase, rnb)
            rewritten += lost
            if group is not None:
                assert cuts is not None
                gw = next_group(group, changed[cuts[i]:cuts[i + 1]] - start, step, rnb)
        if gw is None:
            gw = fresh_group(nr, rnb, step)
        slot = BlockSlot(nr, len(gw.group.pieces), sum(p.nbytes for p in gw.group.pieces))
        slot.group = gw.group
        slots.append(slot)
        if gw.rows is None:
            parts.append((start, start + nr))
            writes.append(BlockWrite(i, GROUPED, pos, pos + nr, None, group=gw))
        else:
            parts.append(gw.rows + start)
            writes.append(BlockWrite(i, GROUPED, pos, pos + len(gw.rows), gw.rows, group=gw))
        pos += writes[-1].stop - writes[-1].start
    return slots, writes, parts, pos, rewritten

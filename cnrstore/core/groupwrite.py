"""Writing the grouped layout's objects (core/grouppolicy.py decides them): a block
version's new row objects, then its list node. Apart from writer.py, which calls it for
every block the grouped layout writes, local or a rank's part of a distributed put."""

from __future__ import annotations

import numpy as np

from cnrstore.core import grouppolicy
from cnrstore.core.blockplan import BlockWrite, TablePlan
from cnrstore.core.grouppolicy import GroupWrite, ListBase, Piece, fresh_group
from cnrstore.format.rowlists import (
    KIND_BLOCK_LIST,
    KIND_BLOCK_ROWS,
    LIST_READ_CAP,
    encode_list,
    encode_list_delta,
    encode_rows,
)

__all__ = ["write_group", "write_fresh", "write_grouped"]


def write_group(w, slot, gw: GroupWrite, codes: np.ndarray, elem: int) -> bool:
    """Put a grouped block version through ``w`` (``put`` and ``has``): its new row
    objects (``codes``: the block's written rows), then its list node, whose id goes
    into ``slot``. False (the list not written) when a listed object of an earlier put
    is missing."""
    gw.group.settle_base()  # first: a version not written must not keep its predecessor
    for piece, sel, start, rates in gw.new:
        if sel is None:
            payload = encode_rows(slot.nrows, codes[start:start + piece.count],
                                  step=piece.step, cls=piece.cls, elem=elem, start=start)
        else:
            assert gw.rows is not None
            payload = encode_rows(slot.nrows, codes[sel], step=piece.step, cls=piece.cls,
                                  elem=elem, index=gw.rows[sel], rates=rates)
        piece.oid = w.put(KIND_BLOCK_ROWS, payload)
    pieces = gw.group.pieces
    refs = [p.oid for p in pieces if p.oid is not None]
    if len(refs) != len(pieces):
        return False
    base = gw.group.base
    # one index read for the ~350 listed objects (a ``has`` each took a read transaction
    # each: most of a grouped put's time at 1% changed rows)
    gone = w.missing([*refs, base.oid] if base is not None else refs)
    if any(r in gone for r in refs):
        return False
    delta = (None if base is None or base.oid in gone
             else _delta(base, tuple(refs), pieces, slot.nrows * codes.shape[1]))
    if base is not None and delta is not None:
        drop, m = delta
        added = pieces[m:]
        payload, nrefs = encode_list_delta(
            base.oid, base.nbytes, drop, tuple(refs[m:]),
            np.array([p.cls for p in added]), np.array([p.count for p in added]),
            np.array([p.step for p in added]), gw.group.born)
        slot.oid = w.put(KIND_BLOCK_LIST, payload, nrefs, meta=True)
        return True
    payload, nrefs = encode_list(tuple(refs), np.array([p.cls for p in pieces]),
                                 np.array([p.count for p in pieces]),
                                 np.array([p.step for p in pieces]), gw.group.born)
    slot.oid = w.put(KIND_BLOCK_LIST, payload, nrefs, meta=True)
    gw.group.base = ListBase(slot.oid, tuple(refs), sum(p.nbytes for p in pieces))
    return True


def _delta(base: ListBase, refs: tuple[bytes, ...], pieces: list[Piece], block_nbytes: int
           ) -> tuple[np.ndarray, int] | None:
    """(base positions dropped, how many leading entries come from the base) of the list
    ``refs`` as a delta of ``base``; None when it should be written whole: its entries
    past DELTA_SHARE of the base's, or the base's and added objects past what a read
    plans for (rowlists.plan_list), or not the base's order (never, as next_group keeps
    it)."""
    at = {r: i for i, r in enumerate(base.refs)}
    m = 0
    while m < len(refs) and refs[m] in at:
        m += 1
    pos = np.array([at[r] for r in refs[:m]], dtype=np.int64)
    if any(r in at for r in refs[m:]) or np.any(np.diff(pos) <= 0):
        return None
    keep = np.zeros(len(base.refs), dtype=bool)
    keep[pos] = True
    drop = np.flatnonzero(~keep)
    if len(drop) + len(refs) - m > grouppolicy.DELTA_SHARE * len(base.refs):
        return None
    if base.nbytes + sum(p.nbytes for p in pieces[m:]) > (LIST_READ_CAP - 1) * block_nbytes:
        return None
    return drop, m


def write_fresh(w, plan: TablePlan, slot, codes: np.ndarray, elem: int) -> bool:
    """Block ``slot`` written whole again as chunk objects (its listed objects were gone
    under the writer lock, or it was reused and its list is gone); counted rewritten."""
    gw = fresh_group(slot.nrows, plan.state.row_nbytes, plan.step)
    slot.group = gw.group
    slot.depth, slot.chain_bytes = len(gw.group.pieces), sum(p.nbytes for p in gw.group.pieces)
    plan.rewritten_blocks += 1
    return write_group(w, slot, gw, codes, elem)


def write_grouped(w, plan: TablePlan, slot, bw: BlockWrite, codes: np.ndarray, elem: int
                  ) -> bool:
    """Block write ``bw`` of the grouped layout; False when an object it lists is gone
    and the plan kept no full codes to write the block fresh from."""
    assert bw.group is not None
    older = [p.oid for p in bw.group.group.pieces if p.step != plan.step]
    gone = bw.rows is not None and (None in older or bool(w.missing(older)))
    if gone and plan.full_codes is not None:
        start = bw.index * plan.state.block_rows
        return write_fresh(w, plan, slot, plan.full_codes[start:start + slot.nrows], elem)
    if bw.index in plan.damaged_blocks:
        plan.rewritten_blocks += 1
    return write_group(w, slot, bw.group, codes, elem)

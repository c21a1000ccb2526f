"""The rows whose stored codes differ between two versions of one block, and the codes of
one side for them, reading as little as the patch chains allow (docs/MANIFEST.md,
"Changes between steps").

Between two steps of one run a block's newer version is usually a chain of patches on top
of the older one. The union of those patches' row indices is then every row that can
differ, and the newer side's codes of those rows are in the patches themselves: no full
block is read. A row that only one patch of the chain wrote differs from the older
version under "exact" (the writer puts a row in a patch only when its fingerprint
changed), so it is taken as it is. Rows several patches wrote (they may have been
written back) and every row of a lossy table (a changed value may quantize to the same
codes) are checked against the older version's codes where its own patches hold them;
the rest are reported as they are, unless ``strict`` asks to read the older full block
too (a block that holds nothing written between the two steps). Versions not related
by a chain (a block rewritten full, a grown or shrunk last block, another branch after a
rollback) are both decoded and compared row by row: a block at a time, never a table.

Only ``get(oid) -> engine.Object`` is needed, so the same code runs over a local store
and over the objects a distributed coordinator located for a rank.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cnrstore.errors import ManifestError
from cnrstore.format.blocks import decode_full, decode_patch, resolve
from cnrstore.format.manifest import KIND_BLOCK_FULL, KIND_BLOCK_PATCH
from engine import Object

__all__ = ["BlockDiff", "diff_block", "new_block"]

# Patch chains are bounded by the writer (max_chain, default 16); searching deeper costs a
# little and still finds chains written with a larger bound (as tools/diff.py does).
_CHAIN_SEARCH = 64

Get = Callable[[bytes], Object]


class BlockDiff:
    """Offsets (ascending, int64) within block b of the rows that differ, and b's codes of
    them (``uint8[len(rows), row_nbytes]``, writable)."""

    __slots__ = ("rows", "codes", "patches", "decoded")

    def __init__(self, rows: np.ndarray, codes: np.ndarray, patches: int, decoded: int):
        self.rows, self.codes = rows, codes
        self.patches = patches    # patches whose indices answered
        self.decoded = decoded    # full blocks decoded (both sides counted)


class _Cached:
    """``get`` with the objects of one block pair kept: a failed chain search has read the
    objects that the comparison then decodes."""

    def __init__(self, get: Get):
        self._get = get
        self._seen: dict[bytes, Object] = {}

    def __call__(self, oid: bytes) -> Object:
        obj = self._seen.get(oid)
        if obj is None:
            obj = self._seen[oid] = self._get(oid)
        return obj


def _chain(get: _Cached, top: bytes, base: bytes) -> list[tuple[bytes, Object]] | None:
    """The patches from ``top`` down to (not including) ``base``, newest first; None when
    ``base`` is not below ``top``."""
    out: list[tuple[bytes, Object]] = []
    cur = top
    for _ in range(_CHAIN_SEARCH):
        obj = get(cur)
        if obj.kind != KIND_BLOCK_PATCH or len(obj.refs) != 1:
            return None
        out.append((cur, obj))
        cur = obj.refs[0]
        if cur == base:
            return out
    return None


def _patch_rows(chain: list[tuple[bytes, Object]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows written by the chain, how many patches wrote each, the newest codes of each)."""
    parts = [decode_patch(obj, oid) for oid, obj in chain]
    rnb = parts[0][0].row_nbytes
    for (oid, _), (head, _, _) in zip(chain, parts):
        if (head.nrows, head.row_nbytes) != (parts[0][0].nrows, rnb):
            raise ManifestError("patch does not match the patches above it", oid=oid)
    idx_all = np.concatenate([p[1] for p in parts])
    rows, counts = np.unique(idx_all, return_counts=True)
    codes = np.empty((len(rows), rnb), dtype=np.uint8)
    done = np.zeros(len(rows), dtype=bool)
    for _, idx, part in parts:  # newest first: a row takes the first patch that has it
        pos = np.searchsorted(rows, idx)
        fresh = ~done[pos]
        codes[pos[fresh]] = part[fresh]
        done[pos[fresh]] = True
    return rows, counts, codes


def _codes_at(get: _Cached, oid: bytes, rows: np.ndarray, rnb: int, *, full: bool,
              depth: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """Codes of ``rows`` in block ``oid``: from its newest patch holding each row, then
    (``full``) from its full block for the rest, read only if some are left. ``depth``
    (the segment node's) is the number of patches above the full block, so that a full
    block is not read only to learn that it is one. Returns (codes, which rows were
    found, full blocks decoded)."""
    codes = np.empty((len(rows), rnb), dtype=np.uint8)
    left = np.ones(len(rows), dtype=bool)
    cur = oid
    for level in range(1 << 16):
        if not left.any() or (not full and depth is not None and level >= depth):
            return codes, ~left, 0
        obj = get(cur)
        if obj.kind == KIND_BLOCK_FULL:
            if not full:
                return codes, ~left, 0
            block = decode_full(obj, cur)
            if block.shape[1] != rnb or (len(rows) and rows[-1] >= len(block)):
                raise ManifestError("block does not match the patches above it", oid=cur)
            codes[left] = block[rows[left]]
            return codes, np.ones(len(rows), dtype=bool), 1
        head, idx, part = decode_patch(obj, cur)
        if head.row_nbytes != rnb:
            raise ManifestError("patch does not match its chain's row size", oid=cur)
        if len(idx):
            pos = np.minimum(np.searchsorted(idx, rows), len(idx) - 1)
            hit = left & (idx[pos] == rows)
            codes[hit] = part[pos[hit]]
            left &= ~hit
        cur = obj.refs[0]
    raise ManifestError("patch chain too deep (cycle?)", oid=oid)


def new_block(get: Get, oid: bytes) -> BlockDiff:
    """Every row of block ``oid`` (a block the other step does not have)."""
    codes = resolve(get, oid)
    return BlockDiff(np.arange(len(codes), dtype=np.int64), codes, 0, 1)


def diff_block(get: Get, a: bytes, b: bytes, common: int, *, exact: bool, b_newer: bool,
               strict: bool = False, depths: tuple[int, int] | None = None,
               codes: bool = True) -> BlockDiff:
    """The rows of block b that may differ from block a: rows below ``common`` (rows both
    versions hold) whose codes differ, and every row from ``common`` on. ``exact``: the
    table's scheme is "exact" (a row one patch wrote differs). ``b_newer``: b is the later
    step's version, so its chain is searched first. Where b's version is patches on a's,
    a row whose codes may be unchanged (written more than once, or lossy) is compared with
    a's codes when a's own patches hold them; with ``strict`` a's full block is read for
    the rest, otherwise they are reported (with b's codes: a replay stays exact).
    ``depths``: the segment nodes' patch depths of a and b, when known. ``codes=False``:
    only the rows are wanted (``BlockDiff.codes`` is then empty where b's codes would
    cost reads of their own)."""
    cached = _Cached(get)
    first, second = ((b, a), (a, b)) if b_newer else ((a, b), (b, a))
    for top, base in (first, second):
        chain = _chain(cached, top, base)
        if chain is None:
            continue
        rows, counts, top_codes = _patch_rows(chain)
        rnb = top_codes.shape[1]
        check = np.ones(len(rows), dtype=bool) if not exact else counts > 1
        # b's codes are what a replica receives: when b is the base, all of them are read.
        need = np.ones(len(rows), dtype=bool) if top == a and codes else check
        base_codes = np.empty((len(rows), rnb), dtype=np.uint8)
        found = np.zeros(len(rows), dtype=bool)
        decoded = 0
        if need.any():
            depth = None if depths is None else depths[0 if base == a else 1]
            got, hit, decoded = _codes_at(cached, base, rows[need], rnb,
                                          full=strict or (top == a and codes), depth=depth)
            base_codes[need], found[need] = got, hit
        differs = np.ones(len(rows), dtype=bool)
        cmp = check & found
        if rnb:
            differs[cmp] = np.any(top_codes[cmp] != base_codes[cmp], axis=1)
        else:
            differs[cmp] = False
        keep = differs & (rows < common)
        if top == b:
            b_codes = top_codes[keep]
        else:
            b_codes = base_codes[keep] if codes else np.empty((0, rnb), dtype=np.uint8)
        return BlockDiff(rows[keep], b_codes, len(chain), decoded)
    ca, cb = resolve(cached, a), resolve(cached, b)
    n = min(common, len(ca), len(cb))
    if ca.shape[1] != cb.shape[1]:
        raise ManifestError("two versions of a block differ in row size", oid=b)
    same_rows = np.flatnonzero(np.any(ca[:n] != cb[:n], axis=1)).astype(np.int64)
    rows = np.concatenate([same_rows, np.arange(n, len(cb), dtype=np.int64)])
    return BlockDiff(rows, cb[rows], 0, 2)

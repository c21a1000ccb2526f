"""A model of what a long run must write (issue 27): union growth, a lower bound, and the
chain policy replayed on the bench's rows, in seconds instead of bench_longrun's hours.

Parts, all on the rows benches/workload.py changes (Zipf s=1.05, the bench's two
500 K-row tables, 32768-row blocks of 256-byte rows):

- ``union``: the share of a table's rows changed at least once in t steps. Each row r
  changes per step with probability p_r = 1 - exp(-c w_r) (w_r = 1/(r+1)^s, c such that
  the p_r add up to the rows a step changes); u(t) = mean(1 - (1 - p_r)^t). Printed next
  to the measured union of the workload's own rows.
- ``bound``: the least write a store could reach if it grouped rows by their rate, each
  group's base copy rewritten at its own period T (writing a row once per T steps: 1/T;
  its base copy stale from its first change on, a share 1 - (1-(1-p)^T)/(T p') of the
  time, p' = -ln(1-p)); minimized under "stale base copies <= 0.5 of the table" (the
  restore-read target). It ignores the stale versions in patches, so a real store does
  worse; and it needs objects that hold rows by rate, which blocks of consecutive rows
  are not.
- ``family``: the least extra write of any policy that keeps a full block, one merged
  patch of the union since it and the patches above: a full rewrite every T steps, a
  merge every m, each merge writing u(t) and the patches f per step; minimized over T and
  m with the chain averaging <= 0.5 of a block (the read target, blocks staggered).
- ``collapse_bound``: the least write of ANY chain on whole-block bases (full block
  rewritten every T steps, every row version since read), each row free to be collapsed
  (rewritten, its older versions dropped) at its own period: looser than a ref chain.
- ``hot_policy``: the policy with a patch H of the block's hot rows (change rate by an
  exponential average) on top of the chain, rewritten every step; ``family(hot=)`` its
  family bound.
- ``piece_policy``: rows grouped by change rate, a block version as a list of row
  objects cleaned to a read target (not built; the design, its format and figures are
  in docs/design/diff-base.md, "Rows grouped by rate").
- ``grouped_replay``: the grouped layout's own write code (core/grouppolicy.py
  next_group, core/groupwrite.py write_group) run per block on the changed rows, its
  objects counted instead of stored: bench_longrun's write and read figures to ~0.01x
  (1% int8, last 45 of 300: 1.701x against 1.70x; 5% exact 1.493x against 1.492x).
- ``policy``: cnrstore's chain policy (core/chainpolicy.py: per-block budget over
  BUDGET_RANGE of the block's bytes, merged patch of the union since the full block when
  <= MERGE_SHARE of the budget, else a full block; depth caps of max_chain 64) replayed
  per block, with the patch bytes optionally divided by a compression ratio. At 5% it
  gives bench_longrun's measured figures to 0.01x (150 steps: 2.09x, first 45 1.92x,
  last 45 2.17x, read 1.51x).

    .venv/bin/python benches/model_longrun.py                # all three, 200 steps
    .venv/bin/python benches/model_longrun.py --steps 60 --budget 0.5:1 0.3:0.6
    .venv/bin/python benches/model_longrun.py --steps 150 --budget 0.5:1 0.4:0.9 0.6:1.2 \
        --hot 0.2:0.7:0.5 0.05:0.5:0.3                      # issue 27, hot patch (~1 CPU min)
    .venv/bin/python benches/model_longrun.py --steps 300 --no-bounds \
        --pieces 0.02:0.04,0.1,0.3 0.05:0.1,0.4 --max-list 0 64  # rows grouped by rate
    .venv/bin/python benches/model_longrun.py --steps 300 --no-bounds --row-bytes 68 \
        --pieces 0.02:0.04,0.1,0.3                           # the same, int8 codes
    .venv/bin/python benches/model_longrun.py --grouped --steps 300 --row-bytes 68
        # the grouped layout's own code replayed (grouped_replay), int8 codes, at the
        # layout's block_rows (core/options.py GROUPED_BLOCK_ROWS; --block-rows N to vary)
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benches.workload import ZIPF_S, Workload, changed_rows  # noqa: E402

ROWS = 500_000
TABLES = 2
BLOCK = 32768
RNB = 256
PATCH_HEAD = 24  # blocks.py _PATCH.size
INDEX = 2        # u16 row indices in a block of <= 65536 rows
_PHI = (5 ** 0.5 - 1) / 2


def rates(fraction: float, rows: int = ROWS) -> np.ndarray:
    """Per-row change probability of one step of the Zipf workload (see the docstring)."""
    w = 1.0 / np.arange(1, rows + 1, dtype=np.float64) ** ZIPF_S
    k = fraction * rows
    lo, hi = 1e-6, 1e15
    for _ in range(200):  # bisect c in log space: sum(1 - exp(-c w)) = k
        c = (lo * hi) ** 0.5
        if (-np.expm1(-c * w)).sum() < k:
            lo = c
        else:
            hi = c
    return -np.expm1(-c * w)


def union(fraction: float, steps: list[int], rows_of: list[np.ndarray]) -> list[str]:
    p = rates(fraction)
    seen = np.zeros(ROWS, dtype=bool)
    got = {}
    for t, ids in enumerate(rows_of, 1):
        seen[ids] = True
        got[t] = seen.mean()
    return [f"u({t}) = {float((1 - (1 - p) ** t).mean()):.3f} (measured "
            f"{got.get(t, float('nan')):.3f})" for t in steps]


def bound(fraction: float, read: float = 0.5, p: np.ndarray | None = None
          ) -> tuple[float, float]:
    """(least extra write / changed rows' bytes, stale share) with stale <= ``read``;
    ``p``: the rows' change rates (default: the Zipf workload's at ``fraction``)."""
    p = rates(fraction) if p is None else np.asarray(p, dtype=np.float64)
    edges = np.geomspace(p.min() * 0.999, 1.0, 300)
    b = np.digitize(p, edges)
    groups = np.unique(b)
    P = np.array([p[b == g].mean() for g in groups])[:, None]
    N = np.array([(b == g).sum() for g in groups])
    T = np.unique(np.round(np.geomspace(1, 1e5, 400)))[None, :]
    stale = 1 - (1 - (1 - P) ** T) / (T * -np.log1p(-np.minimum(P, 1 - 1e-12)))
    extra = np.broadcast_to(1 / T, stale.shape)
    floor = (N * P[:, 0]).sum()
    best = (float("inf"), 0.0)
    for lam in np.geomspace(1e-4, 1e2, 400):
        j = np.argmin(extra + lam * stale, axis=1)
        e = float((N * extra[np.arange(len(N)), j]).sum() / floor)
        s = float((N * stale[np.arange(len(N)), j]).sum() / len(p))
        if s <= read and e < best[0]:
            best = (e, s)
    return best


def family(fraction: float, read: float = 0.5, longest: int = 1000, hot: float = 2.0
           ) -> tuple[float, int, int]:
    """(least extra write / changed rows' bytes, T, m) of the family (see the docstring).
    ``hot``: rows with p_r >= hot sit in a patch H on top of the chain, rewritten whole
    every step (the hot set of ``hot_policy``): they leave the union and add their share
    of the table to the chain and their unchanged share (1 - p_r) to every step."""
    p = rates(fraction)
    h = p >= hot
    share, waste = float(h.mean()), float((1 - p[h]).sum() / len(p))
    cold, p = fraction - float(p[h].sum() / len(p)), np.where(h, 0.0, p)
    u = np.array([float((1 - (1 - p) ** t).mean()) for t in range(longest + 1)])
    best = (float("inf"), 0, 0)
    for T in range(5, longest, 5):
        t = np.arange(T)
        for m in range(1, T + 1):
            last = (t // m) * m
            chain = np.where(t >= m, u[last], 0.0) + cold * (t - last) + share
            if chain.mean() <= read:
                extra = (1 + u[np.arange(m, T, m)].sum()) / (T * fraction) + waste / fraction
                if extra < best[0]:
                    best = (float(extra), T, m)
    return best


def collapse_bound(fraction: float, read: float = 0.5) -> tuple[float, int, float]:
    """(least write / changed rows' bytes, T, read) of ANY chain whose base is the whole
    block, rewritten every T steps: a restore reads every version of a row written since
    the full block (one version per change), except that a row may be collapsed every k
    steps (its current value written again, its older versions dropped; k per row, in
    1..T). That is looser than a ref chain, where dropping an object rewrites every row
    of the objects above it, so no policy on full blocks and patches writes less."""
    p = rates(fraction)
    edges = np.geomspace(p.min() * 0.999, 1.0, 200)
    b = np.digitize(p, edges)
    P = np.array([p[b == g].mean() for g in np.unique(b)])
    N = np.array([(b == g).sum() for g in np.unique(b)])
    best = (float("inf"), 0, 0.0)
    for T in (10, 15, 20, 25, 30, 40, 50, 60, 80, 100, 130, 160, 200, 250, 300, 400):
        t = np.arange(T)[None, :]
        ws, rs = [], []
        for k in np.unique(np.round(np.geomspace(1, T, 40)).astype(int)):
            last = (t // k) * k
            rs.append((np.where(last > 0, 1 - (1 - P[:, None]) ** last, 0)
                       + P[:, None] * (t - last)).mean(axis=1))
            at = np.arange(k, T, k)[None, :]  # a collapse there also writes its change
            ws.append(((1 - (1 - P[:, None]) ** at).sum(axis=1) - P * at.shape[1]) / T)
        W, R = np.array(ws).T, np.array(rs).T
        for lam in np.geomspace(1e-3, 1e3, 300):
            j = np.argmin(W + lam * R, axis=1)
            r = float((N * R[np.arange(len(N)), j]).sum() / N.sum())
            w = 1 + float((N * W[np.arange(len(N)), j]).sum() + N.sum() / T) / (N * P).sum()
            if r <= read and w < best[0]:
                best = (w, T, r)
    return best


def _block_bounds(table: int, block: int, budget: tuple[float, float],
                  max_chain: int) -> tuple[int, float, int]:
    """Block ``block`` of table ``table``: its rows, chain budget (bytes) and depth cap,
    spread as chainpolicy spreads them."""
    n = min(BLOCK, ROWS - block * BLOCK)
    spread = (((zlib.crc32(f"t{table}".encode()) & 0xFFFF) + block) * _PHI) % 1.0
    cap = (budget[0] + (budget[1] - budget[0]) * spread) * n * RNB
    return n, cap, max(1, round(max_chain * (0.5 + 0.5 * spread)))


def policy(rows_of: list[list[np.ndarray]], fraction: float, budget: tuple[float, float],
           merge: float, ratio: float = 1.0, max_chain: int = 64) -> dict:
    """Replay the chain policy; bytes per step written and read above the full blocks."""
    steps = len(rows_of[0])
    cost, read = np.zeros(steps), np.zeros(steps)
    nb = -(-ROWS // BLOCK)
    for t in range(TABLES):
        for i in range(nb):
            n, cap, depth_cap = _block_bounds(t, i, budget, max_chain)
            changed, chain, depth = np.zeros(n, dtype=bool), 0.0, 0
            for s in range(steps):
                ids = rows_of[t][s]
                a, z = np.searchsorted(ids, [i * BLOCK, (i + 1) * BLOCK])
                r = ids[a:z] - i * BLOCK
                if len(r):
                    p = (PATCH_HEAD + len(r) * (RNB + INDEX)) / ratio
                    changed[r] = True
                    m = (PATCH_HEAD + changed.sum() * (RNB + INDEX)) / ratio
                    if depth < depth_cap and chain + p <= cap:
                        chain, depth = chain + p, depth + 1
                        cost[s] += p
                    elif m <= merge * cap:
                        chain, depth = m, 1
                        cost[s] += m
                    else:
                        chain, depth, changed[:] = 0.0, 0, False
                        cost[s] += n * RNB
                read[s] += chain
    return _figures(rows_of, cost, read)


def _patch(rows: int) -> float:
    return float(PATCH_HEAD + rows * (RNB + INDEX)) if rows else 0.0


def hot_policy(rows_of: list[list[np.ndarray]], budget: tuple[float, float], merge: float,
               alpha: float, enter: float, leave: float, max_chain: int = 64) -> dict:
    """Replay the chain F <- M <- P1 .. Pk <- H per block: H holds the current codes of
    the block's hot rows and is rewritten every step (the new step's chain drops the old
    H), P one step's changed rows outside the hot set plus the rows leaving it, M the
    merged patch of the cold rows that differ from F. A row is hot while its change rate
    (exponential average, weight ``alpha`` per step) is >= ``enter``, until it drops below
    ``leave``. The budget, merge share and depth cap (counting M and the P, not H) are
    the policy's, H counted in the chain's bytes. Also returns the objects written per
    block per step (last 45 steps) and the deepest chain (H included)."""
    steps = len(rows_of[0])
    cost, raw, read, objs = (np.zeros(steps) for _ in range(4))
    nb, deepest = -(-ROWS // BLOCK), 0
    for t in range(TABLES):
        for i in range(nb):
            n, cap, depth_cap = _block_bounds(t, i, budget, max_chain)
            rate = np.zeros(n)
            hot, differs = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
            low, depth, top = 0.0, 0, 0.0  # bytes of M + P, their count, bytes of H
            for s in range(steps):
                ids = rows_of[t][s]
                a, z = np.searchsorted(ids, [i * BLOCK, (i + 1) * BLOCK])
                changed = np.zeros(n, dtype=bool)
                changed[ids[a:z] - i * BLOCK] = True
                rate *= 1 - alpha
                rate[changed] += alpha
                now = (rate >= enter) | (hot & (rate >= leave))
                differs |= changed
                if changed.any():
                    prow = int(((changed & ~now) | (hot & ~now & differs)).sum())
                    p, h = _patch(prow), _patch(int((now & differs).sum()))
                    if depth + (prow > 0) <= depth_cap and low + p + h <= cap:
                        low, depth, top = low + p, depth + (prow > 0), h
                        cost[s] += p + h
                        objs[s] += (prow > 0) + (h > 0)
                    elif _patch(int((differs & ~now).sum())) + h <= merge * cap:
                        low, depth, top = _patch(int((differs & ~now).sum())), 1, h
                        cost[s] += low + h
                        objs[s] += 1 + (h > 0)
                    else:
                        low, depth, top = 0.0, 0, 0.0
                        differs[:] = False
                        cost[s] += n * RNB
                        objs[s] += 1
                    hot = now
                    deepest = max(deepest, depth + (top > 0))
                read[s] += low + top
    r = _figures(rows_of, cost, read)
    r.update(objects=float(objs[-min(45, steps):].mean() / (TABLES * nb)), depth=deepest)
    return r


# What a store writes and reads per engine object beyond its payload (docs/FORMAT.md,
# "Records" and "Index"): a record is 44 + 16 per ref + payload + 8 bytes, its trailer entry
# 33 and its LMDB entry 16 (key) + 42 + 16 per ref; measured on disk (st_blocks, commits of
# 200-1000 objects of 5 KB): 340 bytes per object, besides ~8 KB per commit (the same for
# every policy, one commit a step).
RECORD = 52
OBJECT_DISK = 340
REF = 16
# A block version's entry per piece object in its segment node: the ref and the object's
# piece and row count (msgpack ints).
LIST_ENTRY = 24
COMMIT_DISK = 8192


def _index_bytes(rows: np.ndarray, span: np.ndarray, bitmap: bool) -> np.ndarray:
    """Bytes of a piece object's row-id list: none when it holds every row of its span,
    else u16 ids, or a bitmap of the span where that is smaller (``bitmap``)."""
    ids = INDEX * rows.astype(np.float64)
    if bitmap:
        ids = np.minimum(ids, np.ceil(span / 8))
    return np.where(rows >= span, 0.0, ids)


def piece_policy(rows_of: list[list[np.ndarray]], alpha: float, thresholds: list[float],
                 lam: float | None, chunk_rows: int = BLOCK, hyst: float = 0.5,
                 read_cap: float | None = None, bitmap: bool = True,
                 clean: float | tuple[float, float] | None = None, score: str = "greedy",
                 max_list: int = 0, chunk_new: bool = True, list_delta: bool = False,
                 rows: int | None = None,
                 tables: int | None = None, block: int | None = None) -> dict:
    """Replay rows grouped by change rate (docs/design/diff-base.md, "Rows grouped by
    rate"): a block version is a list of row objects (no refs), applied in the order
    they were written; the objects one step writes to a block hold disjoint rows, so a
    row reads its copy in the newest object holding it.

    A row's class is where its change rate (exponential average of "changed", weight
    ``alpha`` a step) falls among ``thresholds`` (ascending); it drops a class only below
    ``hyst`` x that class's threshold. A piece (the objects a step writes a row into) is
    one warmer class of the block, or class 0: one piece for the rows written since the
    full put (``chunk_new`` False), or one per span of ``chunk_rows`` rows. The full put
    writes the block as one object per span of ``chunk_rows``. Each step writes one
    object per piece that has rows to write: its changed rows (a changed row goes to its
    class at once) and the rows moved into it. An object none of whose rows is the
    newest leaves the list for nothing.

    ``clean`` (a read target, or a range the blocks' targets spread over): when a block's
    next version would read more than that share of its bytes, its objects are cleaned,
    in order of stale bytes per live row (x age for ``score`` "age"), until it would not;
    a cleaned object's newest rows are written again into their class's piece and it
    leaves the list. ``max_list``: also clean the objects with fewest live rows while the
    list would hold more (0: no limit). ``lam`` (instead of cleaning, H in the doc): a
    piece is rewritten whole when its bytes beyond one copy of its rows (S) satisfy
    T S - sum S >= s L / ``lam`` (T steps since its last rewrite, L its rows' bytes, s a
    stagger in [0.5, 1.5)); ``read_cap`` then rewrites the pieces of most S per row first
    while a block would read more than that share.

    Counts every byte a store writes: rows, patch headers, row-id lists (u16, or a bitmap
    of the span where smaller with ``bitmap``), OBJECT_DISK per object and the list:
    LIST_ENTRY per listed object at every step of a changed block, or with
    ``list_delta`` a list node per block written again when the entries added (and 4
    bytes per entry removed) since it pass half its size, the segment node holding those.
    Returns _figures' figures, the per-step bytes written and read above the table
    (``step_bytes``, ``step_read``), the write beyond the changed rows (``parts``, in
    changed rows' bytes; ``copies_by``: copies by destination class), the stale bytes
    by class (``stale_by``, mean share of the table), objects written per block per step
    over the last 45 and the longest list."""
    rows = ROWS if rows is None else rows
    tables = TABLES if tables is None else tables
    block = BLOCK if block is None else block
    steps = len(rows_of[0])
    th = np.asarray(thresholds, dtype=np.float64)
    K = len(th) + 1
    cost, read = np.zeros(steps), np.zeros(steps)
    parts = dict.fromkeys(("copies", "ids", "objects", "list"), 0.0)
    nb, written, longest = -(-rows // block), np.zeros(steps), 0
    copies_by, stale_by = np.zeros(K), np.zeros(K)
    for t in range(tables):
        for i in range(nb):
            n = min(block, rows - i * block)
            nch = -(-n // chunk_rows)
            one = 0 if chunk_new else 1  # a piece for class 0's rows written since the put
            P = nch + one + K - 1
            local = np.arange(n)
            chunk = local // chunk_rows
            span = np.concatenate([np.bincount(chunk, minlength=nch),
                                   np.full(one + K - 1, n)]).astype(np.float64)
            cls_of = np.concatenate([np.zeros(nch + one, dtype=np.int64), np.arange(1, K)])
            cold = chunk if chunk_new else np.full(n, nch)
            key = (zlib.crc32(f"t{t}".encode()) & 0xFFFF) + i * P
            stag = 0.5 + ((key + np.arange(P)) * _PHI) % 1.0
            if clean is not None:
                lo, hi = clean if isinstance(clean, tuple) else (clean, clean)
                target = (lo + (hi - lo) * ((key * _PHI) % 1.0)) * n * RNB
            cap = steps * P + nch
            o_piece = np.zeros(cap, dtype=np.int64)
            o_live = np.zeros(cap, dtype=np.int64)
            o_read = np.zeros(cap)
            o_step = np.zeros(cap)
            o_piece[:nch], o_live[:nch] = np.arange(nch), span[:nch]
            o_read[:nch] = PATCH_HEAD + span[:nch] * RNB + RECORD  # the full put's pieces
            nobj, owner, piece = nch, chunk.copy(), chunk.copy()
            rate = np.zeros(n)
            base_m, delta = nch, 0.0
            T, A, S = np.ones(P), np.zeros(P), np.zeros(P)
            S[:nch] = PATCH_HEAD + RECORD
            A[:] = S
            for s in range(steps):
                ids = rows_of[t][s]
                a, z = np.searchsorted(ids, [i * block, (i + 1) * block])
                r = ids[a:z] - i * block
                changed = np.zeros(n, dtype=bool)
                changed[r] = True
                rate *= 1 - alpha
                rate[r] += alpha
                cur = cls_of[piece]
                up = np.searchsorted(th, rate, side="right")
                down = np.searchsorted(th * hyst, rate, side="right")
                tgt = np.where(up > cur, up, np.where(down < cur, down, cur))
                dest_of = np.where(tgt == 0, cold, nch + one + tgt - 1)
                live_p = np.bincount(piece, minlength=P).astype(np.float64)
                L = live_p * RNB
                if lam is None:
                    urge = np.full(P, -1.0)
                else:
                    urge = T * S - A - stag * L / lam
                fire = (urge >= 0) & (live_p > 0)
                if read_cap is not None:
                    alive = o_live[:nobj] > 0
                    est = o_read[:nobj][alive].sum() + len(r) * (RNB + INDEX)
                    order = np.argsort(-(S / np.maximum(live_p, 1)))
                    for q in order:
                        if est <= read_cap * n * RNB:
                            break
                        if not fire[q] and live_p[q] > 0:
                            fire[q], est = True, est - S[q]
                moving = fire[piece]
                if clean is not None:
                    live_after = o_live[:nobj] - np.bincount(owner[r], minlength=nobj)
                    keep = live_after > 0
                    est = (o_read[:nobj][keep].sum() + len(r) * (RNB + INDEX)
                           + (PATCH_HEAD + RECORD) * K)
                    over = max_list and int(keep.sum()) + K > max_list
                    if est > target or over:
                        freed = np.where(keep, o_read[:nobj] - live_after * (RNB + INDEX)
                                         - PATCH_HEAD - RECORD, 0.0)
                        stale = np.where(keep, o_read[:nobj] - live_after * RNB, 0.0)
                        gain = stale / np.maximum(live_after, 1)
                        if score == "age":
                            gain = gain * (s - o_step[:nobj] + 1)
                        order = np.argsort(-np.where(keep, gain, -np.inf))
                        need = np.searchsorted(np.cumsum(freed[order]),
                                               est - target) + 1
                        if over:  # the list's length: the least live objects go too
                            few = np.argsort(np.where(keep, live_after, np.inf))
                            extra = few[:int(keep.sum()) + K - max_list]
                        else:
                            extra = np.zeros(0, dtype=np.int64)
                        gone = np.zeros(nobj, dtype=bool)
                        gone[order[:need] if est > target else []] = True
                        gone[extra] = True
                        gone &= keep
                        moving |= gone[owner]
                w = np.flatnonzero(changed | moving)
                d = dest_of[w]
                cnt = np.bincount(d, minlength=P)
                qs = np.flatnonzero(cnt)
                new = nobj + np.arange(len(qs))
                slot = np.zeros(P, dtype=np.int64)
                slot[qs] = new
                was = int((o_live[:nobj] > 0).sum())
                o_live[:nobj] -= np.bincount(owner[w], minlength=nobj)
                owner[w], piece[w] = slot[d], d
                c = cnt[qs].astype(np.float64)
                idx = _index_bytes(c, span[qs], bitmap)
                o_piece[new], o_live[new], o_step[new] = qs, cnt[qs], s
                o_read[new] = PATCH_HEAD + c * RNB + idx + RECORD
                nobj += len(qs)
                alive = o_live[:nobj] > 0
                assert o_live[:nobj].sum() == n  # every row has one newest copy
                m = int(alive.sum())
                longest = max(longest, m)
                if not len(w):
                    listed = 0.0
                elif list_delta:  # entries since the block's last list node, and a ref
                    delta += LIST_ENTRY * len(qs) + 4 * (was - (m - len(qs)))
                    if delta > LIST_ENTRY * base_m / 2:
                        base_m, delta = m, 0.0
                        listed = OBJECT_DISK + LIST_ENTRY * m + REF
                    else:
                        listed = REF + delta
                else:
                    listed = LIST_ENTRY * m
                step_bytes = float((o_read[new] - RECORD + OBJECT_DISK).sum()) + listed
                cost[s] += step_bytes
                written[s] += len(qs)
                parts["copies"] += (len(w) - len(r)) * RNB
                moved = w[~changed[w]]
                copies_by += np.bincount(cls_of[dest_of[moved]], minlength=K) * RNB
                parts["ids"] += float(idx.sum()) + PATCH_HEAD * len(qs)
                parts["objects"] += OBJECT_DISK * len(qs)
                parts["list"] += listed
                bytes_p = np.bincount(o_piece[:nobj][alive], weights=o_read[:nobj][alive],
                                      minlength=P)
                S = bytes_p - np.bincount(piece, minlength=P) * RNB
                stale_by += np.bincount(cls_of, weights=S, minlength=K)
                T[fire], A[fire] = 0, 0
                T += 1
                A += S
                lists = LIST_ENTRY * base_m + delta if list_delta else LIST_ENTRY * m
                read[s] += float(bytes_p.sum()) + lists - n * RNB
    out = _figures(rows_of, cost, read, rows=rows, tables=tables)
    raw = sum(len(x) for tab in rows_of for x in tab) * RNB
    out.update(step_bytes=cost, step_read=read,
               parts={k: v / raw for k, v in parts.items()}, longest=longest,
               copies_by=copies_by / raw, stale_by=stale_by / (steps * tables * rows * RNB),
               objects=float(written[-min(45, steps):].mean() / (tables * nb)))
    return out


class _CountingWriter:
    """What groupwrite.write_group writes through, counted, no store: ``put`` returns a
    fresh id and adds the object's bytes on disk (payload, OBJECT_DISK, REF per ref)."""

    def __init__(self) -> None:
        self.n = 0
        self.bytes = {"rows": 0.0, "objects": 0.0, "lists": 0.0}
        self.sizes: dict[bytes, int] = {}

    def put(self, kind: int, payload: bytes, refs: tuple = (), meta: bool = False) -> bytes:
        self.n += 1
        oid = self.n.to_bytes(16, "little")
        self.sizes[oid] = len(payload) + REF * len(refs)
        self.bytes["lists" if meta else "rows"] += len(payload) + REF * len(refs)
        self.bytes["objects"] += OBJECT_DISK
        return oid

    def has(self, oid: bytes) -> bool:
        return True

    def missing(self, oids) -> set[bytes]:
        return set()


class _Slot:
    def __init__(self, nrows: int) -> None:
        self.nrows = nrows
        self.oid: bytes | None = None


def grouped_replay(rows_of: list[list[np.ndarray]], row_nbytes: int, elem: int = 1,
                   rows: int | None = None, tables: int | None = None,
                   block: int | None = None) -> dict:
    """The grouped layout's own write policy (core/grouppolicy.py next_group and
    core/groupwrite.py write_group, the code a store runs) replayed per block on the
    changed rows, without a store: per step the bytes of every object it writes (payload,
    OBJECT_DISK each, REF per ref) and COMMIT_DISK, per version the listed objects'
    bytes (with RECORD each) and its list node(s) as a restore reads them. ``block``:
    rows a block (default the grouped layout's, core/options.py GROUPED_BLOCK_ROWS)."""
    from cnrstore.core import groupwrite
    from cnrstore.core.grouppolicy import fresh_group, next_group
    from cnrstore.core.options import GROUPED_BLOCK_ROWS
    rows = ROWS if rows is None else rows
    tables = TABLES if tables is None else tables
    block = GROUPED_BLOCK_ROWS if block is None else block
    steps = len(rows_of[0])
    cost = np.full(steps, float(COMMIT_DISK))
    read = np.zeros(steps)
    w = _CountingWriter()
    copies = 0.0
    for t in range(tables):
        for i in range(-(-rows // block)):
            n = min(block, rows - i * block)
            slot = _Slot(n)
            gw = fresh_group(n, row_nbytes, 0)
            dummy = np.zeros((n, row_nbytes), dtype=np.uint8)
            groupwrite.write_group(w, slot, gw, dummy, elem)
            group = gw.group
            for s in range(steps):
                ids = rows_of[t][s]
                a, z = np.searchsorted(ids, [i * block, (i + 1) * block])
                r = ids[a:z] - i * block
                if len(r):
                    before = sum(w.bytes.values())
                    gw = next_group(group, r, s + 1, row_nbytes)
                    assert gw.rows is not None
                    copies += (len(gw.rows) - len(r)) * row_nbytes
                    groupwrite.write_group(w, slot, gw, dummy[:len(gw.rows)], elem)
                    group = gw.group
                    cost[s] += sum(w.bytes.values()) - before
                assert slot.oid is not None
                base = group.base
                lists = w.sizes[slot.oid] + RECORD + (
                    0 if base is None or base.oid == slot.oid else w.sizes[base.oid] + RECORD)
                read[s] += sum(p.nbytes + RECORD for p in group.pieces) + lists - n * row_nbytes
    raw = np.array([sum(len(rows_of[t][s]) for t in range(tables)) * row_nbytes
                    for s in range(steps)], dtype=np.float64)
    out = {}
    k = min(45, steps)
    for end in sorted({steps, *(e for e in (150, 300) if e <= steps)}):
        tail = slice(end - k, end)
        out[f"last45@{end}"] = cost[tail].sum() / raw[tail].sum()
        out[f"spike45@{end}"] = cost[tail].max() / np.median(cost[tail])
    out.update(all=cost.sum() / raw.sum(), read=1 + read.max() / (tables * rows * row_nbytes),
               read_last=1 + read[-k:].max() / (tables * rows * row_nbytes),
               parts={key: v / raw.sum() for key, v in w.bytes.items()},
               copies=copies / raw.sum(), step_bytes=cost)
    return out


def _figures(rows_of: list[list[np.ndarray]], cost: np.ndarray, read: np.ndarray,
             rows: int | None = None, tables: int | None = None) -> dict:
    rows = ROWS if rows is None else rows
    tables = TABLES if tables is None else tables
    steps = len(cost)
    raw = np.array([sum(len(rows_of[t][s]) for t in range(tables)) * RNB
                    for s in range(steps)], dtype=np.float64)
    k = min(45, steps)
    tail = slice(steps - k, steps)
    return {"first45": cost[:k].sum() / raw[:k].sum(), "all": cost.sum() / raw.sum(),
            "last45": cost[tail].sum() / raw[tail].sum(),
            "spike_last45": cost[tail].max() / np.median(cost[tail]),
            "spike": cost.max() / np.median(cost),
            "read": 1 + read.max() / (tables * rows * RNB)}


def main(argv: list[str] | None = None) -> int:
    global BLOCK, RNB
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05])
    ap.add_argument("--budget", nargs="+", default=["0.5:1"], metavar="LO:HI")
    ap.add_argument("--merge-share", type=float, default=0.5)
    ap.add_argument("--block-rows", type=int, default=None,
                    help=f"rows a block (default {BLOCK}; --grouped: the grouped layout's, "
                         "core/options.py GROUPED_BLOCK_ROWS)")
    ap.add_argument("--ratio", type=float, nargs="+", default=[1.0],
                    help="compression ratio of patch bytes (1.18: exact rows in planes)")
    ap.add_argument("--hot", nargs="*", default=[], metavar="ALPHA:ENTER:LEAVE",
                    help="also replay hot_policy (a hot-row patch on top, per step)")
    ap.add_argument("--pieces", nargs="*", default=[], metavar="ALPHA:T1,T2,..",
                    help="also replay piece_policy: rows in classes by their change rate "
                         "(exponential average ALPHA, class thresholds T1 < T2 ..; "
                         "'0.05:' one class), objects cleaned to the --clean read target")
    ap.add_argument("--clean", default="1.48", metavar="LO[:HI]",
                    help="piece_policy: a block's read target, spread over LO..HI")
    ap.add_argument("--score", choices=("age", "greedy"), default="age")
    ap.add_argument("--chunk-rows", type=int, default=2048,
                    help="piece_policy: rows of the full put's objects")
    ap.add_argument("--max-list", type=int, nargs="+", default=[0],
                    help="piece_policy: most objects a block's list holds (0: no limit)")
    ap.add_argument("--full-lists", action="store_true",
                    help="piece_policy: the segment node lists every object at every step "
                         "(default: a list node per block and the entries since it)")
    ap.add_argument("--rewrite", type=float, nargs="*", default=[], metavar="LAMBDA",
                    help="piece_policy without object cleaning: whole pieces rewritten "
                         "(weight LAMBDA), reads held to --clean's HI")
    ap.add_argument("--row-bytes", type=int, default=RNB,
                    help="encoded bytes per row (256: exact fp32; 68: int8 codes)")
    ap.add_argument("--no-bounds", action="store_true")
    ap.add_argument("--grouped", action="store_true",
                    help="replay the grouped layout's own code (core/grouppolicy.py, "
                         "groupwrite.py) at --row-bytes, no store: bench_longrun's bytes "
                         "to ~0.01x in ~30 s a setting")
    a = ap.parse_args(argv)
    if a.grouped:
        for frac in a.fractions:
            work = Workload(frac, "zipf")
            rows_of = [[changed_rows(ROWS, work, seed=0, step=s, table_index=t)
                        for s in range(1, a.steps + 1)] for t in range(TABLES)]
            g = grouped_replay(rows_of, a.row_bytes, block=a.block_rows)
            last = ", ".join(f"last 45 of {k[7:]} {v:.3f}x (max/median {g['spike' + k[4:]]:.2f}x)"
                             for k, v in g.items() if k.startswith("last45@"))
            print(f"{work.name}: grouped, {a.row_bytes}-byte rows: write/raw {last}, all "
                  f"{g['all']:.3f}x; max restore read {g['read']:.3f}x; cleaner copies "
                  f"{g['copies']:.3f}x; " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                      g["parts"].items()), flush=True)
        return 0
    BLOCK, RNB = a.block_rows or BLOCK, a.row_bytes
    for frac in a.fractions:
        work = Workload(frac, "zipf")
        rows_of = [[changed_rows(ROWS, work, seed=0, step=s, table_index=t)
                    for s in range(1, a.steps + 1)] for t in range(TABLES)]
        print(f"{work.name}: " + "; ".join(union(frac, [10, 20, 40, 100], rows_of[0])))
        for hot in ([2.0] + [float(h.split(":")[1]) for h in a.hot]) * (not a.no_bounds):
            e, T, m = family(frac, hot=hot)
            print(f"{work.name}: bound, full block + merged patch + patches"
                  + (f" + hot patch (p >= {hot:g})" if hot <= 1 else "") + f": write >= "
                  f"{1 + e:.2f}x the changed rows' bytes (rewrite every {T} steps, merge "
                  f"every {m})", flush=True)
        if not a.no_bounds:
            w, T, r = collapse_bound(frac)
            print(f"{work.name}: bound, any chain on full blocks (rows collapsed at will): "
                  f"write >= {w:.2f}x the changed rows' bytes (rewrite every {T} steps, "
                  f"read {1 + r:.2f}x)", flush=True)
            e, s = bound(frac)
            print(f"{work.name}: bound, rows grouped by rate: write >= {1 + e:.2f}x the "
                  f"changed rows' bytes at stale base copies {s:.2f} of the table")
        for b in a.budget:
            lo, hi = (float(v) for v in b.split(":"))
            for ratio in a.ratio:
                r = policy(rows_of, frac, (lo, hi), a.merge_share, ratio)
                print(f"{work.name}: policy budget {b} merge {a.merge_share:g} ratio "
                      f"{ratio:g}: write/raw first 45 {r['first45']:.2f}x, all {a.steps} "
                      f"{r['all']:.2f}x, last 45 {r['last45']:.2f}x; max/median step "
                      f"(last 45) {r['spike_last45']:.1f}x; max restore read "
                      f"{r['read']:.2f}x", flush=True)
            for h in a.hot:
                alpha, enter, leave = (float(v) for v in h.split(":"))
                r = hot_policy(rows_of, (lo, hi), a.merge_share, alpha, enter, leave)
                print(f"{work.name}: hot {h} budget {b}: write/raw first 45 "
                      f"{r['first45']:.2f}x, all {a.steps} {r['all']:.2f}x, last 45 "
                      f"{r['last45']:.2f}x; max/median step (last 45) "
                      f"{r['spike_last45']:.1f}x; max restore read {r['read']:.2f}x; "
                      f"{r['objects']:.2f} objects per block per step, chain depth <= "
                      f"{r['depth']}", flush=True)
        lo, _, hi = a.clean.partition(":")
        clean = (float(lo), float(hi or lo))
        for spec in a.pieces:
            alpha, _, ths = spec.partition(":")
            th = [float(v) for v in ths.split(",") if v]
            for ml in a.max_list:
                for lam in a.rewrite or [None]:
                    kw = (dict(lam=lam, read_cap=clean[1]) if lam is not None else
                          dict(lam=None, clean=clean, score=a.score, max_list=ml,
                               list_delta=not a.full_lists))
                    r = piece_policy(rows_of, float(alpha), th, chunk_rows=a.chunk_rows,
                                     chunk_new=False, **kw)
                    what = (f"rewrite {lam:g}" if lam is not None else
                            f"clean {a.clean} {a.score} max-list {ml}")
                    print(f"{work.name}: pieces {spec} {what}: write/raw first 45 "
                          f"{r['first45']:.2f}x, all {a.steps} {r['all']:.2f}x, last 45 "
                          f"{r['last45']:.2f}x; max/median step {r['spike']:.1f}x (last "
                          f"45 {r['spike_last45']:.1f}x); max restore read {r['read']:.2f}x;"
                          f" {r['objects']:.1f} objects per block per step, list <= "
                          f"{r['longest']}; write beyond the rows: " + ", ".join(
                              f"{k} {v:.3f}" for k, v in r["parts"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

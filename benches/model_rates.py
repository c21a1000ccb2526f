"""Per-row rate estimators for the grouped layout, replayed (issue 27; docs/design/
grouped-layout.md, "Rate estimators"): ``model_longrun.grouped_replay`` with
``grouppolicy.next_group``'s rate swapped for another estimator. Its copy of next_group
is main's at 89ff6be, where the section's figures were measured: the cleaner stops at the
first object past READ_TARGET (``--nearest``: the nearest) and sizes ids without Rice
codes; objects are written by the layout's current code.

Estimators (SPEC):

- ``ema:ALPHA``: what the layout did before counts, and does for an older store's blocks
  (u8 log-scale code, decayed per step); ``emaf:ALPHA`` the same unquantized.
- ``cw:BETA:A:B``: a decayed count of changes n and of steps observed w (weight 1 - BETA a
  step; 0: no decay), rate (n + A) / (w + B); unquantized (a bound on any code of it).
- ``cwn:B[:CAP]``: cw:0:0:B held exactly: the u8 code a row's count of changes since its
  block was written whole (capped at CAP, default 254), its window the steps since then.
  What the layout now does (grouppolicy.counted_rates, B = COUNT_PRIOR) up to its first
  halving at COUNT_EPOCH steps; ``ema:0.01`` is what it did before.
- ``cwq:BETA:B[:DITHER[:AC]]``: cw:BETA:0:B as a u8 code could hold it: the rate stored as
  the layout's log code, each row's window the steps since its block was written whole
  (step 0 here; a store would need that step in its list node). DITHER 1: the code
  rounded up with probability its fraction, by a hash of (row, step), not to the nearest;
  AC: a changed row classed by n - AC (the change that selected it left out).
- ``cwa:BETA:B:K``: cwq, dithered, the weight of a step max(1 / (w + B), rate / K).
- ``bayes``: the posterior mean of the rate given n changes in w steps under the rows'
  true distribution of rates (unquantized; the workload's prior, not a policy).
- ``oracle``: every row's true change probability (not a policy).

``--nearest``: the cleaner stops at the object nearest READ_TARGET, not the first past it.
Rows are cached in /tmp per (fraction, steps, seed).

    PYTHONPATH=$PWD nice -n 19 .venv/bin/python benches/model_rates.py ema:0.01 cw:0:0:400
    PYTHONPATH=$PWD nice -n 19 .venv/bin/python benches/model_rates.py --fraction 0.01 \
        --steps 300 --row-bytes 256 ema:0.01 cwq:0.001:400:1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benches import model_longrun as ml  # noqa: E402
from benches.workload import Workload, _permutation, changed_rows  # noqa: E402
from cnrstore.core import grouppolicy as gp  # noqa: E402
from cnrstore.format.rowlists import rate_code, rate_value, rows_nbytes  # noqa: E402

_FRESH = gp.fresh_group


class Ema:
    def __init__(self, alpha: float, quantized: bool = True):
        self.alpha, self.q = alpha, quantized

    def init(self, nrows: int, p: np.ndarray) -> np.ndarray:
        return np.full(nrows, 255, np.uint8) if self.q else np.zeros(nrows)

    def step(self, rq, age, ch):
        prev = rate_value(rq) if self.q else rq
        rate = prev * (1.0 - self.alpha) ** age + self.alpha * ch
        return rate, (rate_code(rate) if self.q else rate)

    def codes(self, state, rate):
        return state if self.q else rate_code(rate)


class CountWindow:
    def __init__(self, beta: float, a: float, b: float):
        self.beta, self.a, self.b = beta, a, b

    def init(self, nrows: int, p: np.ndarray) -> np.ndarray:
        return np.zeros((nrows, 2))

    def step(self, rq, age, ch):
        if self.beta:
            d = (1.0 - self.beta) ** age
            n, w = rq[:, 0] * d + ch, rq[:, 1] * d + (1 - d) / self.beta
        else:
            n, w = rq[:, 0] + ch, rq[:, 1] + age
        rate = np.maximum(n + self.a, 0.0) / (w + self.b)
        return np.maximum(rate, 1e-4), np.stack([n, w], axis=1)

    def codes(self, state, rate):
        return rate_code(rate)


class CountCoded:
    """cw:0:0:B as a u8 code can hold it exactly: each row's count of changes since its
    block was written whole (step 0 here; a store would need that step in its list
    node), capped at CAP, rate n / (w + B) with w the steps since then."""

    def __init__(self, b: float, cap: float = 254):
        self.b, self.cap = b, cap

    def init(self, nrows: int, p: np.ndarray) -> np.ndarray:
        return np.zeros(nrows, np.uint8)

    def step(self, rq, age, ch, step):
        n = np.minimum(rq + ch, self.cap)
        return n / (step + self.b), n.astype(np.uint8)

    def codes(self, state, rate):
        return state


class CountWindowCoded:
    """cw:BETA:0:B with the rate stored as the layout's u8 log code and each row's window
    the steps since its block was written whole (step 0 in the replay)."""

    def __init__(self, beta: float, b: float, dither: float = 0, ac: float = 0):
        self.beta, self.b, self.dither, self.ac = beta, b, dither, ac

    def init(self, nrows: int, p: np.ndarray) -> np.ndarray:
        return np.full(nrows, 255, np.uint8)

    def code(self, rate, step):
        if not self.dither:
            return rate_code(rate)
        # rounded up with probability the fraction: a hash of (row, step), so the code is
        # a function of what the store holds
        i = np.arange(len(rate), dtype=np.uint64)
        h = i * np.uint64(0x9E3779B97F4A7C15) + np.full(len(rate), step, np.uint64) \
            * np.uint64(0xC2B2AE3D27D4EB4F)
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
        u = (h >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
        with np.errstate(divide="ignore"):
            k = -16.0 * np.log2(np.maximum(rate, 1e-300))
        k = np.floor(k) + (u < k - np.floor(k))
        return np.where(rate > 2.0 ** (-254.5 / 16), np.clip(k, 0, 254), 255).astype(np.uint8)

    def weff(self, t):
        return (1.0 - (1.0 - self.beta) ** t) / self.beta if self.beta else t

    def step(self, rq, age, ch, step):
        s = step - age
        n = rate_value(rq) * (self.weff(s) + self.b) * (1.0 - self.beta) ** age + ch
        rate = n / (self.weff(step) + self.b)
        code = self.code(rate, step)
        if self.ac:  # a changed row's class without (part of) the change that selected it
            rate = np.maximum(n - self.ac * ch, 0.0) / (self.weff(step) + self.b)
        return rate, code

    def codes(self, state, rate):
        return state


class AdaptiveCoded(CountWindowCoded):
    """cwq with a per-row window: the weight of a step max(1 / (w + B), rate / K), so a
    row that changes often averages over its last ~K changes (its code's rounding then
    small against a change's weight) and a rare one over its whole window."""

    def __init__(self, beta: float, b: float, k: float, dither: float = 1):
        super().__init__(beta, b, dither)
        self.k = k

    def step(self, rq, age, ch, step):
        s = step - age
        r0 = rate_value(rq)
        ra = r0 * (self.weff(s) + self.b) * (1.0 - self.beta) ** age / (self.weff(step) + self.b)
        rb = r0 / (1.0 + r0 * age / self.k)
        r = np.minimum(ra, rb)
        rate = r + ch * np.maximum(1.0 / (self.weff(step) + self.b), r / self.k) * (1.0 - r)
        return rate, self.code(rate, step)


class Bayes:
    """The posterior mean of a row's rate given n changes in w steps, under the true
    distribution of the rows' rates (the Zipf workload's): the best any count/window
    state can tell."""

    def __init__(self, prior: np.ndarray, wmax: int = 400):
        edges = np.geomspace(prior.min() * 0.999, 1.0, 600)
        b = np.digitize(prior, edges)
        cnt = np.bincount(b, minlength=len(edges) + 1).astype(np.float64)
        pm = np.bincount(b, weights=prior, minlength=len(edges) + 1) / np.maximum(cnt, 1)
        keep = cnt > 0
        cnt, pm = cnt[keep], np.minimum(pm[keep], 1 - 1e-9)
        n = np.arange(wmax + 1)[:, None, None]
        w = np.arange(wmax + 1)[None, :, None]
        with np.errstate(invalid="ignore"):
            ll = n * np.log(pm) + np.maximum(w - n, 0) * np.log1p(-pm) + np.log(cnt)
        ll = np.where(n <= w, ll, -np.inf)
        m = ll.max(axis=2, keepdims=True)
        e = np.exp(ll - np.where(np.isfinite(m), m, 0))
        with np.errstate(invalid="ignore"):
            self.table = np.nan_to_num((e * pm).sum(axis=2) / e.sum(axis=2))
        self.wmax = wmax

    def init(self, nrows: int, p: np.ndarray) -> np.ndarray:
        return np.zeros((nrows, 2))

    def step(self, rq, age, ch):
        n, w = rq[:, 0] + ch, rq[:, 1] + age
        wi = np.minimum(w, self.wmax).astype(np.int64)
        ni = np.minimum(n, wi).astype(np.int64)
        return self.table[ni, wi], np.stack([n, w], axis=1)

    def codes(self, state, rate):
        return rate_code(rate)


class Oracle:
    def init(self, nrows: int, p: np.ndarray) -> np.ndarray:
        return p.copy()

    def step(self, rq, age, ch):
        return rq, rq

    def codes(self, state, rate):
        return rate_code(rate)


def parse(spec: str, fraction: float):
    kind, *args = spec.split(":")
    v = [float(x) for x in args]
    if kind == "ema":
        return Ema(*v)
    if kind == "emaf":
        return Ema(*v, quantized=False)
    if kind == "cw":
        return CountWindow(*v)
    if kind == "cwn":
        return CountCoded(*v)
    if kind == "cwq":
        return CountWindowCoded(*v)
    if kind == "cwa":
        return AdaptiveCoded(*v)
    if kind == "bayes":
        return Bayes(ml.rates(fraction))
    if kind == "oracle":
        return Oracle()
    raise SystemExit(f"unknown estimator {spec}")


def make_next_group(est, thresholds, hysteresis, nearest=False):
    """grouppolicy.next_group with its rate lines swapped for ``est`` (the rest verbatim)."""
    def next_group(old, changed, step, row_nbytes):
        nrows = len(old.owner)
        pieces = old.pieces
        npieces = len(pieces)
        pstep = np.array([p.step for p in pieces], dtype=np.int64)
        pcls = np.array([p.cls for p in pieces], dtype=np.int64)
        pbytes = np.array([p.nbytes for p in pieces], dtype=np.float64)
        owner = old.owner.astype(np.int64)
        ch = np.zeros(nrows, dtype=np.float64)
        ch[changed] = 1.0
        age = (step - pstep[owner]).astype(np.float64)
        coded = isinstance(est, (CountWindowCoded, CountCoded))
        rate, state = est.step(old.rq, age, ch, step) if coded else est.step(old.rq, age, ch)
        srate = rate_value(state) if isinstance(est, CountWindowCoded) else rate
        cur = pcls[owner]
        th = np.asarray(thresholds)
        up = np.searchsorted(th, rate, side="right")
        down = np.searchsorted(th * hysteresis, rate, side="right")
        target_cls = np.where(up > cur, up, np.where(down < cur, down, cur))
        ncls = len(th) + 1

        live = np.bincount(owner, minlength=npieces)
        live_after = live - np.bincount(owner[changed], minlength=npieces)
        keep = live_after > 0
        per_row = row_nbytes + 2
        ccodes = est.codes(state[changed], srate[changed])
        ccls = target_cls[changed]
        est_b = float(pbytes[keep].sum()) + sum(
            rows_nbytes(nrows, int((ccls == k).sum()), row_nbytes, rates=ccodes[ccls == k])
            for k in range(ncls) if (ccls == k).any())
        target = gp.READ_TARGET * nrows * row_nbytes
        gone = np.zeros(npieces, dtype=bool)
        if est_b > target:
            freed = np.where(keep, pbytes - live_after * per_row - 36.0, 0.0)
            stale = np.where(keep, pbytes - live_after * row_nbytes, 0.0)
            gain = stale / np.maximum(live_after, 1) * (step - pstep + 1)
            order = np.argsort(-np.where(keep, gain, -np.inf), kind="stable")
            cum = np.cumsum(freed[order])
            need = int(np.searchsorted(cum, est_b - target)) + 1
            if nearest and 1 < need <= len(cum) and (
                    est_b - target - cum[need - 2] < cum[need - 1] - (est_b - target)):
                need -= 1  # the object nearest the target, not the first past it
            gone[order[:need]] = True
            gone &= keep
        mask = np.zeros(nrows, dtype=bool)
        mask[changed] = True
        mask |= gone[owner]
        rows = np.flatnonzero(mask)
        dest = target_cls[rows]

        kept = np.flatnonzero(keep & ~gone)
        remap = np.full(npieces, -1, dtype=np.int64)
        remap[kept] = np.arange(len(kept))
        new_owner = remap[owner]
        listed = [pieces[j] for j in kept]
        new_rq = old.rq.copy()
        new_rq[rows] = state[rows]
        codes = est.codes(state[rows], srate[rows])
        new = []
        for k in range(ncls):
            sel = np.flatnonzero(dest == k)
            if not len(sel):
                continue
            piece = gp.Piece(None, k, step, len(sel),
                             rows_nbytes(nrows, len(sel), row_nbytes, rates=codes[sel]))
            new_owner[rows[sel]] = len(listed)
            listed.append(piece)
            new.append((piece, sel, 0, codes[sel]))
        assert (new_owner >= 0).all()
        version = gp.ListedVersion(listed, new_owner.astype(np.int32), new_rq, old.base,
                                   after=old)
        return gp.GroupWrite(version, new, rows)
    return next_group


def make_fresh_group(est, blocks):
    """fresh_group, its state the estimator's (blocks: each block's true rates, in the
    order the replay writes them fresh)."""
    it = iter(blocks)

    def fresh_group(nrows, row_nbytes, step):
        gw = _FRESH(nrows, row_nbytes, step)
        gw.group.rq = est.init(nrows, next(it))
        gw.group.born = None  # the estimator keeps its own state; lists as main wrote them
        return gw
    return fresh_group


def rows_for(fraction: float, steps: int, seed: int = 0) -> list[list[np.ndarray]]:
    cache = Path(f"/tmp/model_rates_rows_{fraction:g}_{steps}_{seed}.npz")
    if cache.exists():
        z = np.load(cache)
        return [[z[f"t{t}s{s}"] for s in range(steps)] for t in range(ml.TABLES)]
    work = Workload(fraction, "zipf")
    rows_of = [[changed_rows(ml.ROWS, work, seed=seed, step=s, table_index=t)
                for s in range(1, steps + 1)] for t in range(ml.TABLES)]
    np.savez(cache, **{f"t{t}s{s}": rows_of[t][s] for t in range(ml.TABLES)
                       for s in range(steps)})
    return rows_of


def true_rates(fraction: float, block: int, seed: int = 0) -> list[np.ndarray]:
    p_rank = ml.rates(fraction)
    out = []
    for t in range(ml.TABLES):
        p = np.empty(ml.ROWS)
        p[_permutation(ml.ROWS, seed, t)] = p_rank
        out += [p[i:i + block] for i in range(0, ml.ROWS, block)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="+", metavar="SPEC")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--row-bytes", type=int, default=68)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nearest", action="store_true",
                    help="the cleaner stops at the object nearest READ_TARGET")
    ap.add_argument("--thresholds", default=",".join(map(str, gp.THRESHOLDS)))
    ap.add_argument("--hysteresis", type=float, default=gp.HYSTERESIS)
    a = ap.parse_args(argv)
    from cnrstore.core.options import GROUPED_BLOCK_ROWS
    rows_of = rows_for(a.fraction, a.steps, a.seed)
    th = tuple(float(x) for x in a.thresholds.split(","))
    for spec in a.specs:
        est = parse(spec, a.fraction)
        gp.next_group = make_next_group(est, th, a.hysteresis, a.nearest)
        gp.fresh_group = make_fresh_group(est, true_rates(a.fraction, GROUPED_BLOCK_ROWS, a.seed))
        g = ml.grouped_replay(rows_of, a.row_bytes)
        k = f"last45@{a.steps}"
        print(f"{a.fraction:g} {a.row_bytes}B {a.steps} s{a.seed} {spec} th={a.thresholds} "
              f"hyst={a.hysteresis:g}{' nearest' * a.nearest}: last45 {g[k]:.4f}x "
              f"read {g['read']:.4f}x "
              f"spike {g['spike45@' + str(a.steps)]:.2f}x all {g['all']:.4f}x copies "
              f"{g['copies']:.3f}x rows {g['parts']['rows']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

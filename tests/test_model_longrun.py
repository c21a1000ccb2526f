"""benches/model_longrun.py's rate-grouped replay (``piece_policy``, issue 27): the
invariants the figures of docs/design/diff-base.md ("Rows grouped by rate") rest on, on
small synthetic tables (a second each); the figures themselves at the bench's scale under
-m slow."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benches import model_longrun  # noqa: E402

ROWS = 16384
SMALL = dict(rows=ROWS, tables=1, block=4096, chunk_rows=1024, chunk_new=False)
CLASSES = dict(alpha=0.02, thresholds=[0.04, 0.1, 0.3])


def _rows(steps: int, seed: int = 0) -> tuple[np.ndarray, list]:
    """Rows changing at Zipf-like rates min(1, 200 / rank) (~6.6% a step), ranks
    scattered over the table: the rates and the changed rows of each step."""
    rng = np.random.default_rng(seed)
    p = rng.permutation(np.minimum(1.0, 200.0 / np.arange(1, ROWS + 1)))
    return p, [[np.flatnonzero(rng.random(ROWS) < p) for _ in range(steps)]]


def _write(r: dict, lo: int, hi: int, rows_of: list) -> float:
    raw = sum(len(x) for x in rows_of[0][lo:hi]) * model_longrun.RNB
    return float(r["step_bytes"][lo:hi].sum() / raw)


def test_write_is_the_changed_rows_plus_its_parts():
    """Every byte written is a changed row, a copied row, a header or row-id list, an
    object's record and index entry, or a list entry: nothing is left out or counted
    twice."""
    _, rows_of = _rows(40)
    r = model_longrun.piece_policy(rows_of, lam=None, clean=1.3, score="age",
                                   list_delta=True, **CLASSES, **SMALL)
    assert r["all"] == pytest.approx(1 + sum(r["parts"].values()), rel=1e-9)
    assert min(r["parts"].values()) >= 0 and r["parts"]["copies"] > 0
    assert r["read"] > 1.0


def test_without_cleaning_nothing_is_copied_and_reads_grow():
    _, rows_of = _rows(30)
    r = model_longrun.piece_policy(rows_of, lam=None, **CLASSES, **SMALL)
    assert r["parts"]["copies"] == 0
    assert r["step_read"][-1] > r["step_read"][0]


def test_cleaning_holds_reads_at_the_target_and_trades_write_for_read():
    _, rows_of = _rows(60)
    tight, loose = (model_longrun.piece_policy(rows_of, lam=None, clean=c, score="age",
                                               **CLASSES, **SMALL) for c in (1.3, 1.6))
    assert tight["read"] <= 1.3 + 0.01 and loose["read"] <= 1.6 + 0.01
    assert tight["all"] > loose["all"]


def test_the_list_cap_bounds_the_objects_a_restore_reads():
    _, rows_of = _rows(60)
    free, capped = (model_longrun.piece_policy(rows_of, lam=None, clean=1.48, score="age",
                                               max_list=cap, **CLASSES, **SMALL)
                    for cap in (0, 24))
    assert free["longest"] > 24 >= capped["longest"]
    assert capped["all"] > free["all"]


def test_steady_write_is_above_the_bound_of_rows_grouped_by_rate():
    """The bound (each row's base copy rewritten at its own period, stale versions in
    patches ignored) is below what the replay writes once every block has been cleaned:
    the replay counts what the bound leaves out."""
    p, rows_of = _rows(200)
    extra, stale = model_longrun.bound(0.0, read=0.48, p=p)
    assert stale <= 0.48
    r = model_longrun.piece_policy(rows_of, lam=None, clean=1.48, score="age", **CLASSES,
                                   **SMALL)
    assert r["read"] <= 1.49
    assert _write(r, 100, 200, rows_of) >= 1 + extra


@pytest.mark.slow  # ~40 s: the bench's rows of 150 steps at 5%
def test_bench_scale_figures_of_the_design_doc():
    """The figures diff-base.md gives at 5% Zipf, 150 steps, exact: today's policy as
    bench_longrun measured it, and the rate-grouped setting A."""
    from benches.workload import Workload, changed_rows

    work = Workload(0.05, "zipf")
    rows_of = [[changed_rows(model_longrun.ROWS, work, seed=0, step=s, table_index=t)
                for s in range(1, 151)] for t in range(model_longrun.TABLES)]
    today = model_longrun.policy(rows_of, 0.05, (0.5, 1.0), 0.5)
    assert (round(today["last45"], 2), round(today["all"], 2),
            round(today["read"], 2)) == (2.17, 2.09, 1.51)
    r = model_longrun.piece_policy(rows_of, lam=None, clean=1.48, score="age",
                                   chunk_rows=2048, chunk_new=False, list_delta=True,
                                   **CLASSES)
    assert r["last45"] <= 1.5 and r["read"] <= 1.5 and r["spike"] <= 3.0
    assert r["last45"] >= 1 + model_longrun.bound(0.05, read=0.48)[0]


@pytest.mark.slow  # ~80 s: the grouped layout's own code on the bench's rows, int8
def test_grouped_layout_int8_long_run_figures():
    """Issue 27's long-run target for int8 rows in the replay of the layout's own code
    (grouped_replay, its defaults: 131072-row blocks, ALPHA 0.01, nine classes): 1% Zipf
    under 1.5x over the last 45 of 300 steps (1.614x with 32768-row blocks, ALPHA 0.02
    and four classes), 5% within 0.02x of it over the last 45 of 150 (1.559x before);
    reads under 1.5x, no step past 3x the median (docs/design/grouped-layout.md)."""
    from benches.workload import Workload, changed_rows

    for frac, steps, most in ((0.05, 150, 1.52), (0.01, 300, 1.5)):
        work = Workload(frac, "zipf")
        rows_of = [[changed_rows(model_longrun.ROWS, work, seed=0, step=s, table_index=t)
                    for s in range(1, steps + 1)] for t in range(model_longrun.TABLES)]
        g = model_longrun.grouped_replay(rows_of, 68)
        sb = g["step_bytes"]
        assert g[f"last45@{steps}"] <= most, (frac, g[f"last45@{steps}"])
        assert g["read"] <= 1.5 and sb.max() <= 3 * np.median(sb), frac


def test_grouped_replay_runs_the_stores_own_write_path():
    """grouped_replay drives core/groupwrite.write_group through a counting writer that
    must answer the whole writer contract write_group uses (a missing method failed only
    under -m slow): every changed row is written at least once, and a restore reads at
    least the table."""
    _, rows_of = _rows(12)
    g = model_longrun.grouped_replay(rows_of, model_longrun.RNB, rows=ROWS, tables=1,
                                     block=4096)
    assert g["all"] >= 1.0 and g["parts"]["rows"] >= 1.0
    assert g["read"] >= 1.0 and len(g["step_bytes"]) == 12

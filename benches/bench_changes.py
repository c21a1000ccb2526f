"""Benchmark of ``store.changes(a, b)`` (issue 28) against ``get_tables(b)`` and against
comparing two full restores.

The tables and updates of the checkpoint benchmark (benches/workload.py: five fp32
tables of 64-dim rows, 1.075 GB at ``--scale 1``; each interval changes exactly
``fraction`` of every table's rows, Zipf-drawn, so the same hot rows change every time).
Per fraction: a full put, then ``--steps`` incremental puts, all kept. Then, warm (the
store's files were just written, so the page cache holds them, as on a serving host that
follows the trainer):

- changes of one step (``changes(N-1, N)``) and of ``--span`` steps (``changes(N-span, N)``):
  time, and stored bytes of the objects it reads (engine record lengths);
- ``get_tables(N)``: time and stored bytes of every object of the step;
- two full restores compared row by row (``get_tables(a)``, ``get_tables(b)``, then the
  rows whose bytes differ): the way to get the same answer without ``changes``.

    .venv/bin/python benches/bench_changes.py --out /tmp/bench_changes        # 1.075 GB
    .venv/bin/python benches/bench_changes.py --quick --out /tmp/quick         # smoke

Writes ``bench_changes.json`` and ``bench_changes.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import cnrstore  # noqa: E402
from benches.workload import Workload, apply_update, make_tables, table_specs  # noqa: E402
from cnrstore.core.changes import check_request, iter_changes  # noqa: E402
from cnrstore.format.load import load_step  # noqa: E402

TARGET_ONE_STEP = 0.1  # changes of one step at 1%: at most this fraction of get_tables(b)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the results and the stores")
    p.add_argument("--scale", type=float, default=1.0, help="table rows x this (1: 1.075 GB)")
    p.add_argument("--fractions", default="0.01,0.05", help="rows changed per interval")
    p.add_argument("--dist", default="zipf", choices=["zipf", "uniform"])
    p.add_argument("--steps", type=int, default=10, help="incremental puts after the full one")
    p.add_argument("--span", type=int, default=10, help="steps spanned by the long changes")
    p.add_argument("--quant", default="exact", help="scheme of every table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each read (median)")
    p.add_argument("--quick", action="store_true", help="tiny run for CI (scale 0.005)")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.steps, args.span, args.repeat = 0.005, 3, 3, 1
    args.fractions = [float(f) for f in args.fractions.split(",")]
    if args.steps < 1 or not 1 <= args.span <= args.steps:
        p.error("need --steps >= 1 and 1 <= --span <= --steps")
    return args


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return _median(times), out


def changes_bytes(store, a: int, b: int) -> tuple[int, int]:
    """(stored bytes of the objects ``changes(a, b)`` reads, rows it yields)."""
    objects = store.objects
    read = [0]

    def get(oid):
        read[0] += objects.info(oid).stored_len
        return objects.get(oid)

    ra, rb, order, ranges = check_request(get, lambda s: load_step(objects, s), a, b, None,
                                          None)
    rows = sum(len(c.rows) for c in iter_changes(get, a, b, ra, rb, order, ranges))
    return read[0], rows


def step_bytes(store, step: int) -> int:
    """Stored bytes of every object of a step (what a restore of it reads)."""
    objects = store.objects
    _, node = load_step(objects, step)
    return sum(loc.length for loc in objects.locate_closure(list(node.table_ids)).values())


def compare_restores(store, a: int, b: int) -> int:
    """Rows that differ, found from two full restores."""
    ta, tb = store.get_tables(a), store.get_tables(b)
    n = 0
    for name, t in tb.items():
        old = ta.get(name)
        if old is None or old.shape != t.shape:
            n += t.shape[0]
            continue
        n += int((old.view(torch.int32) != t.view(torch.int32)).any(dim=1).sum())
    return n


def run_fraction(args: argparse.Namespace, fraction: float) -> dict:
    work = Workload(fraction, args.dist)
    path = Path(args.out) / f"store-{work.name}"
    shutil.rmtree(path, ignore_errors=True)
    tables = make_tables(table_specs(scale=args.scale), seed=args.seed)
    logical = sum(t.numel() * t.element_size() for t in tables.values())
    with cnrstore.open(path) as store:
        store.put_tables(0, tables, quant=args.quant)
        for step in range(1, args.steps + 1):
            apply_update(tables, work, seed=args.seed, step=step)
            store.put_tables(step, tables, quant=args.quant)
        del tables
        n = args.steps
        out: dict = {"workload": work.name, "logical_bytes": logical, "steps": n,
                     "quant": args.quant}
        get_s, _ = _timed(lambda: store.get_tables(n), args.repeat)
        out["get_tables_s"] = get_s
        out["get_tables_bytes"] = step_bytes(store, n)
        for label, a in (("one_step", n - 1), (f"{args.span}_steps", n - args.span)):
            secs, _ = _timed(lambda a=a: sum(len(c.rows) for c in store.changes(a, n)),
                             args.repeat)
            nbytes, rows = changes_bytes(store, a, n)
            cmp_s, cmp_rows = _timed(lambda a=a: compare_restores(store, a, n), 1)
            out[label] = {
                "a": a, "b": n, "rows": rows, "seconds": secs, "bytes_read": nbytes,
                "time_vs_get_tables": secs / get_s,
                "bytes_vs_get_tables": nbytes / out["get_tables_bytes"],
                "compare_restores_s": cmp_s, "compare_restores_rows": cmp_rows,
                "time_vs_compare_restores": secs / cmp_s,
            }
    shutil.rmtree(path, ignore_errors=True)
    return out


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    lines = [f"# store.changes vs get_tables (scale {args.scale}, {args.quant}, warm)", "",
             "| workload | changes of | rows | changes s | bytes read | vs get_tables time "
             "| vs get_tables bytes | 2 restores + compare s | vs that time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for label in ("one_step", f"{args.span}_steps"):
            c = r[label]
            lines.append(
                f"| {r['workload']} | {c['a']}->{c['b']} | {c['rows']} | {c['seconds']:.4f} "
                f"| {c['bytes_read']} | {c['time_vs_get_tables']:.4f}x "
                f"| {c['bytes_vs_get_tables']:.4f}x | {c['compare_restores_s']:.3f} "
                f"| {c['time_vs_compare_restores']:.4f}x |")
        lines.append(f"| {r['workload']} | get_tables({r['steps']}) | | "
                     f"{r['get_tables_s']:.3f} | {r['get_tables_bytes']} | 1x | 1x | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = [run_fraction(args, f) for f in args.fractions]
    doc = {"args": {k: v for k, v in vars(args).items()}, "results": results,
           "target_one_step_1pct": TARGET_ONE_STEP}
    Path(args.out, "bench_changes.json").write_text(json.dumps(doc, indent=2))
    Path(args.out, "bench_changes.md").write_text(markdown(results, args))
    sys.stdout.write(markdown(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

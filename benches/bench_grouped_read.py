"""Restore time of the grouped layout against chains, in the same run (issue 27).

``--build`` writes two stores under ``--dir``, one per layout, from the same tables and
updates (benches/workload.py, as bench_longrun.py: ``--steps`` incremental puts of
``--fraction`` of the rows, Zipf-drawn) and keeps them. ``--time`` restores the last step
of each, alternating the layouts, warm (best of 3 after one read) and cold (the stores'
files evicted, best of 2), ``--runs`` times, and prints one JSON line per run: so the
read code can be compared on the very same bytes, A/B, by running ``--time`` with one
tree and then the other on ``PYTHONPATH`` (this script puts its own tree last on
sys.path, so ``PYTHONPATH`` decides which code reads).

    PYTHONPATH=$PWD .venv/bin/python benches/bench_grouped_read.py --build --dir /tmp/gr
    PYTHONPATH=$PWD .venv/bin/python benches/bench_grouped_read.py --time --dir /tmp/gr
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

import torch  # noqa: E402

import cnrstore  # noqa: E402
from benches.measure import evict_page_cache, timed  # noqa: E402
from benches.workload import Workload, apply_update, make_tables  # noqa: E402

LAYOUTS = ("grouped", "chains")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="where the two stores are (kept)")
    p.add_argument("--build", action="store_true", help="write the stores first")
    p.add_argument("--time", action="store_true", help="time the stores' restores")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of all tables together")
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--quant", default="exact")
    p.add_argument("--block-rows", type=int, default=None)
    p.add_argument("--runs", type=int, default=1, help="timed rounds (each: both layouts)")
    p.add_argument("--label", default="", help="name of the code version in the output")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not (a.build or a.time):
        p.error("give --build, --time or both")
    return a


def build(args: argparse.Namespace) -> None:
    work = Workload(args.fraction, "zipf")
    per = args.rows // args.tables
    for layout in LAYOUTS:
        path = Path(args.dir) / layout
        shutil.rmtree(path, ignore_errors=True)
        tables = make_tables({f"t{i}": (per, args.dim) for i in range(args.tables)},
                             seed=args.seed)
        opts: dict = {"layout": layout}
        if args.block_rows:
            opts["block_rows"] = args.block_rows
        t0 = time.perf_counter()
        with cnrstore.open(path, **opts) as store:
            store.put_tables(0, tables, quant=args.quant)
            for step in range(1, args.steps + 1):
                apply_update(tables, work, seed=args.seed, step=step)
                store.put_tables(step, tables, quant=args.quant)
        (path.parent / f"{layout}.json").write_text(json.dumps(
            {"layout": layout, "step": args.steps, "fraction": args.fraction,
             "quant": args.quant, "rows": per * args.tables}))
        print(f"built {layout}: {args.steps} steps in {time.perf_counter() - t0:.0f} s",
              flush=True)


def _times(path: Path, step: int) -> tuple[float, float, dict]:
    """(warm, cold) seconds of get_tables(step), best of 3 after one read and best of 2,
    and the tables read."""
    with cnrstore.open(path, readonly=True) as store:
        tables = store.get_tables(step)
        warm = min(timed(lambda: store.get_tables(step))[0] for _ in range(3))
        cold = []
        for _ in range(2):
            evict_page_cache(path)
            cold.append(timed(lambda: store.get_tables(step))[0])
    return warm, min(cold), tables


def time_restores(args: argparse.Namespace) -> None:
    code = Path(cnrstore.__file__).resolve().parents[1]
    for run in range(args.runs):
        got: dict = {}
        for layout in LAYOUTS:
            meta = json.loads((Path(args.dir) / f"{layout}.json").read_text())
            got[layout] = _times(Path(args.dir) / layout, meta["step"])
        (gw, gc, gt), (cw, cc, ct) = got["grouped"], got["chains"]
        # both stores hold the same updates: a faster read that restores other rows is no
        # gain (int8 may round a row differently by layout, so only exact is compared)
        if gt.keys() != ct.keys() or meta["quant"] == "exact" and not all(
                torch.equal(gt[name], ct[name]) for name in ct):
            raise SystemExit("the two layouts restored different tables")
        print(json.dumps({"label": args.label, "code": str(code), "run": run,
                          "grouped_warm_s": round(gw, 4), "grouped_cold_s": round(gc, 4),
                          "chains_warm_s": round(cw, 4), "chains_cold_s": round(cc, 4),
                          "warm_ratio": round(gw / cw, 3), "cold_ratio": round(gc / cc, 3)}),
              flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.build:
        build(args)
    if args.time:
        time_restores(args)


if __name__ == "__main__":
    main()

"""How cost grows (issue 27): put, get, open, gc and verify time and store size against
table size, kept steps and number of tables.

Three sweeps, each in a fresh store under ``--out`` (removed after), fp32 tables of
benches/workload.py, each incremental step changing ``--fraction`` of every table's rows
(uniform draw: at 8 GB a Zipf draw costs more than the put it feeds):

- ``size``: one table of ``--dim``-wide rows, ``--sizes`` GB. Work grows with the bytes.
- ``steps``: one table of ``--steps-rows`` rows, puts kept up to ``--kept`` steps; measured
  at each point. A put, a get of the latest step and an open do the same work at every
  point; verify, gc and the store size grow with the objects kept (linear at most); gc
  dropping all but the newest step grows with the steps it drops.
- ``tables``: ``--tables`` tables of ``--table-rows`` rows each. Work grows with the count.

Per point: the first (full) put, one incremental put, open (close, then ``cnrstore.open``
of the directory), a get of the latest step (warm), ``verify()``, ``gc()`` keeping every
step (mark and sweep of everything live), ``gc(keep_last=1)`` on a copy of the store, and
the store's bytes on disk (``st_blocks``). Times are medians of ``--repeat`` runs where
the operation leaves the store as it was (open, get, verify, gc); the puts run once.

    .venv/bin/python benches/bench_scaling.py --out /tmp/scaling               # the default run
    .venv/bin/python benches/bench_scaling.py --quick --out /tmp/quick          # smoke
    .venv/bin/python benches/bench_scaling.py --plot docs/scaling.png /tmp/scaling/*.json

Writes ``bench_scaling.json`` and ``bench_scaling.md`` under ``--out``. The markdown gives,
per sweep and operation, the log-log slope of cost against the sweep's work between its
last two points (1: linear in the work; 0: flat), flagging any above ``SLOPE_BUG``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import cnrstore  # noqa: E402
from benches.measure import disk_bytes  # noqa: E402
from benches.workload import make_tables  # noqa: E402

OPS = ("put_full", "put_incr", "open", "get", "verify", "gc", "gc_drop", "disk")
# What each operation's work is in each sweep: "x" grows with the swept quantity, "1" does
# not. A slope of cost against x above SLOPE_BUG where the work is "x", or above
# SLOPE_FLAT where it is "1", is a cost growing faster than its work.
WORK = {
    "size": dict.fromkeys(OPS, "x"),
    "tables": dict.fromkeys(OPS, "x"),
    "steps": {"put_full": "1", "put_incr": "1", "open": "1", "get": "1", "verify": "x",
              "gc": "x", "gc_drop": "x", "disk": "x"},
}
SLOPE_BUG = 1.25
SLOPE_FLAT = 0.25
GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sweeps", nargs="+", default=["size", "steps", "tables"],
                   choices=["size", "steps", "tables"])
    p.add_argument("--sizes", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1, 2, 4, 8],
                   help="table sizes in GB (1e9 bytes) for the size sweep")
    p.add_argument("--kept", type=int, nargs="+", default=[1, 3, 10, 30, 100, 300, 1000])
    p.add_argument("--steps-rows", type=int, default=262_144)
    p.add_argument("--tables", type=int, nargs="+", default=[1, 3, 10, 30, 100, 300, 1000])
    p.add_argument("--table-rows", type=int, default=1024)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--quant", default="exact")
    p.add_argument("--block-rows", type=int, default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny tables, few points")
    p.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=True,
                   help="touch 3x the largest size of memory once before the size sweep "
                        "(a VM's first touch of its memory is slow)")
    p.add_argument("--plot", default=None, help="write a PNG from the JSON files given")
    p.add_argument("inputs", nargs="*", help="bench_scaling.json files to plot")
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.kept, a.tables = [0.001, 0.004], [1, 4, 12], [1, 4, 12]
        a.steps_rows, a.table_rows, a.dim, a.repeat = 4096, 256, 16, 1
        a.block_rows = a.block_rows or 256
    if min(a.sizes) <= 0 or min(a.kept) < 1 or min(a.tables) < 1 or a.repeat < 1:
        p.error("--sizes must be > 0, --kept, --tables and --repeat >= 1")
    if not 0 < a.fraction <= 1:
        p.error("--fraction must be in (0, 1]")
    if a.plot and not a.inputs:
        p.error("--plot needs bench_scaling.json files")
    return a


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _change(tables: dict[str, torch.Tensor], fraction: float, step: int) -> None:
    g = torch.Generator().manual_seed(1_000_003 * step + 7)
    for t in tables.values():
        k = max(1, int(fraction * t.shape[0]))
        ids = torch.randint(0, t.shape[0], (k,), generator=g)
        t[ids] += 1e-3


class Point:
    """One store at one point of a sweep; its measurements as a dict."""

    def __init__(self, args: argparse.Namespace, path: Path) -> None:
        self.args, self.path = args, path
        shutil.rmtree(path, ignore_errors=True)
        self.opts = {"block_rows": args.block_rows} if args.block_rows else {}
        self.store = cnrstore.open(path, **self.opts)

    def put(self, step: int, tables: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        self.store.put_tables(step, tables, quant=self.args.quant)
        return time.perf_counter() - t0

    def measure(self) -> dict[str, float]:
        """open, get, verify, gc, gc_drop and disk of the store as it is now."""
        r = self.args.repeat
        out: dict[str, float] = {}

        def reopen() -> None:
            self.store.close()
            self.store = cnrstore.open(self.path, **self.opts)
        out["open"] = _median_time(reopen, r)
        out["get"] = _median_time(lambda: self.store.get_tables(None), r)

        def verify() -> None:
            report = self.store.verify()
            if not report.ok:
                raise SystemExit(f"verify failed in {self.path}: {report.problems[:3]}")
        out["verify"] = _median_time(verify, r)
        out["gc"] = _median_time(lambda: self.store.gc(), r)
        out["disk"] = float(disk_bytes(self.path))  # after gc: live data only
        self.store.close()
        copy = self.path.with_name(self.path.name + "-gc")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(self.path, copy)
        with cnrstore.open(copy, **self.opts) as other:
            t0 = time.perf_counter()
            other.gc(keep_last=1)
            out["gc_drop"] = time.perf_counter() - t0
        shutil.rmtree(copy, ignore_errors=True)
        self.store = cnrstore.open(self.path, **self.opts)
        return out

    def close(self) -> None:
        self.store.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _two_puts(args: argparse.Namespace, path: Path, tables: dict[str, torch.Tensor]
              ) -> dict[str, float]:
    pt = Point(args, path)
    try:
        row = {"put_full": pt.put(0, tables)}
        _change(tables, args.fraction, 1)
        row["put_incr"] = pt.put(1, tables)
        row.update(pt.measure())
    finally:
        pt.close()
    return row


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def prewarm_memory(want: float) -> float:
    """Touch up to ``want`` bytes of fresh memory once (less where the machine has less
    available, 2 GB left over), then free it; returns the bytes touched.

    On a VM the first touch of guest memory also costs the host's fault: on the bench VM
    6 GB filled in 9.1 s the first time and 2.5 s after (7.8 s against 2.4 s of system
    time), so without this a size point's put or get pays it whenever it first needs more
    memory than earlier points did (a 2 GB get took 1.9-2.7 s the first time, 0.46-0.74 s
    after, with no disk read)."""
    n = int(min(want, max(0, _available_bytes() - 2 * GB)))
    chunks, step = [], 1 << 30
    for start in range(0, n, step):
        chunks.append(torch.ones((min(step, n - start) // 4,), dtype=torch.float32))
    del chunks
    return float(n)


def sweep_size(args: argparse.Namespace) -> list[dict]:
    rows_out = []
    if args.prewarm:
        # the table, its restored copy and the store's pages in the page cache
        touched = prewarm_memory(3 * max(args.sizes) * GB)
        print(f"prewarm: touched {touched / GB:.1f} GB", flush=True)
    for gb in args.sizes:
        rows = max(1, int(gb * GB / (4 * args.dim)))
        tables = make_tables({"t0": (rows, args.dim)}, seed=0)
        row = _two_puts(args, Path(args.out) / "store-size", tables)
        del tables
        row["x"] = rows * args.dim * 4 / GB
        rows_out.append(row)
        _report("size", row)
    return rows_out


def sweep_tables(args: argparse.Namespace) -> list[dict]:
    rows_out = []
    for n in args.tables:
        tables = make_tables({f"t{i}": (args.table_rows, args.dim) for i in range(n)}, seed=0)
        row = _two_puts(args, Path(args.out) / "store-tables", tables)
        row["x"] = n
        rows_out.append(row)
        _report("tables", row)
    return rows_out


def sweep_steps(args: argparse.Namespace) -> list[dict]:
    tables = make_tables({"t0": (args.steps_rows, args.dim)}, seed=0)
    pt = Point(args, Path(args.out) / "store-steps")
    rows_out = []
    try:
        put_full = pt.put(0, tables)
        kept = 1
        for target in sorted(set(args.kept)):
            while kept < target:
                _change(tables, args.fraction, kept)
                pt.put(kept, tables)
                kept += 1
            _change(tables, args.fraction, kept)
            put_incr = pt.put(kept, tables)  # the put into a store holding `target` steps
            pt.store.delete_step(kept)  # gc in measure() reclaims it
            row = pt.measure()
            row["put_incr"], row["put_full"], row["x"] = put_incr, put_full, target
            rows_out.append(row)
            _report("steps", row)
    finally:
        pt.close()
    return rows_out


def _report(sweep: str, row: dict) -> None:
    cells = " ".join(f"{op}={row[op]:.4g}" for op in OPS if op != "disk")
    print(f"{sweep} x={row['x']:g}: {cells} disk={row['disk'] / 1e6:.1f}MB", flush=True)


def slopes(sweep: str, rows: list[dict]) -> dict[str, float]:
    """Per operation, d log(cost) / d log(x) between the last two points."""
    if len(rows) < 2:
        return {}
    a, b = rows[-2], rows[-1]
    out = {}
    for op in OPS:
        if a[op] > 0 and b[op] > 0 and b["x"] != a["x"]:
            out[op] = math.log(b[op] / a[op]) / math.log(b["x"] / a["x"])
    return out


def too_fast(sweep: str, op: str, slope: float) -> bool:
    return slope > (SLOPE_BUG if WORK[sweep][op] == "x" else SLOPE_FLAT)


def markdown(doc: dict) -> str:
    units = {"size": "table GB", "steps": "steps kept", "tables": "tables"}
    lines = []
    for sweep, rows in doc["sweeps"].items():
        lines += [f"### {sweep} ({units[sweep]})", "",
                  "| " + units[sweep] + " | " + " | ".join(
                      f"{op} s" for op in OPS if op != "disk") + " | store MB |",
                  "|---" * (len(OPS) + 1) + "|"]
        for r in rows:
            cells = " | ".join(f"{r[op]:.3g}" for op in OPS if op != "disk")
            lines.append(f"| {r['x']:g} | {cells} | {r['disk'] / 1e6:.1f} |")
        s = doc["slopes"].get(sweep, {})
        if s:
            cells = " | ".join(
                f"{s[op]:.2f}{' **!**' if too_fast(sweep, op, s[op]) else ''}"
                for op in OPS if op != "disk")
            lines.append(f"| slope | {cells} | {s['disk']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot(out: str, inputs: list[str]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(Path(f).read_text()) for f in inputs]
    sweeps = [s for s in ("size", "steps", "tables") if any(s in d["sweeps"] for d in docs)]
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.2 * len(sweeps), 4.6), squeeze=False)
    xlabel = {"size": "table size (GB)", "steps": "steps kept", "tables": "number of tables"}
    for ax, sweep in zip(axes[0], sweeps, strict=True):
        for d in (d for d in docs if sweep in d["sweeps"]):
            rows = d["sweeps"][sweep]
            xs = [r["x"] for r in rows]
            for op in OPS:
                if op == "disk":
                    continue
                ax.plot(xs, [r[op] for r in rows], marker="o", ms=3, label=f"{op} s")
            ax2 = ax.twinx()
            ax2.plot(xs, [r["disk"] / 1e6 for r in rows], color="black", ls=":",
                     label="store MB")
            ax2.set_yscale("log")
            ax2.set_ylabel("store size on disk (MB, dotted)", fontsize=8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel[sweep])
        ax.set_ylabel("seconds")
        ax.set_title(f"cost vs {xlabel[sweep]}", fontsize=9)
        ax.grid(True, which="major", lw=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.inputs)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    run = {"size": sweep_size, "steps": sweep_steps, "tables": sweep_tables}
    doc: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("plot", "inputs")},
                 "sweeps": {}, "slopes": {}}
    for sweep in args.sweeps:
        doc["sweeps"][sweep] = run[sweep](args)
        doc["slopes"][sweep] = slopes(sweep, doc["sweeps"][sweep])
        (Path(args.out) / "bench_scaling.json").write_text(json.dumps(doc, indent=1))
    (Path(args.out) / "bench_scaling.md").write_text(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a long run costs (issue 27): bytes on disk per step and bytes a restore reads, over
many incremental puts.

Tables and updates of benches/workload.py (fp32, 64-dim rows; every interval changes
exactly ``fraction`` of each table's rows, Zipf-drawn). Per setting (fraction, scheme,
``max_chain``): a full put, then ``--steps`` incremental puts, all kept. Measured per
step: bytes the store's files gained on disk (``st_blocks``, so what the file system
allocated), against the changed rows' bytes (rows changed x the scheme's row bytes: raw
fp32 rows under exact, int8 codes under int8). Then per kept step the stored bytes of
every object its restore reads (the step's closure, but a grouped delta's dropped objects,
which its base still names for gc; the whole closure's bytes as "max closure"), against
the table's bytes in that scheme (rows x row bytes).

    .venv/bin/python benches/bench_longrun.py --out /tmp/longrun             # 1 M rows, 60 steps
    .venv/bin/python benches/bench_longrun.py --quick --out /tmp/quick        # smoke
    .venv/bin/python benches/bench_longrun.py --steps 150 --budget 0.3:0.6 0.5:1 0.7:1.4 \
        --fractions 0.05 --quant exact --out /tmp/sweep    # the trade-off, steady state
    .venv/bin/python benches/bench_longrun.py --plot docs/longrun.png A.json B.json
    .venv/bin/python benches/bench_longrun.py --layout grouped chains --steps 150 \
        --time-restore --out /tmp/grouped   # rows grouped by rate against chains
    .venv/bin/python benches/bench_longrun.py --layout chains grouped --steps 150 \
        --fractions 0.05 --quant int8 --time-puts --out /tmp/stall   # stalls, spikes included

``--time-puts``: every incremental put is ``put_tables(blocking=False, touched=)`` with the
rows the interval changed (what a tracker hands over: the same changed rows, so the same
objects; the files' allocation may differ by a page), timed until it returns (the stall)
and until its future's result (the put); and every ``--peer-every`` steps torch.save +
fsync of the same tables, both ways (benches/peers.py ``TorchSave``: a file kept, one file
replaced; the faster is the peer). The last 45 steps' mean stall and put (spikes
included) and largest stall are reported over the peer's median.

The first steps after the full put rewrite no block (every block starts fresh), so the
amortized figure of a short run is below what a long run settles at: the "last 45" columns
measure the final 45 steps of the run alone (a steady state once ``--steps`` is well past
the blocks' rewrite period, ~100 steps at 1%). ``--budget LO:HI`` sets the range the
blocks' chain budgets spread over (core/chainpolicy.py ``BUDGET_RANGE``, a what-if: not a
store option), ``--merge-share`` the share of it a merged patch may take.

Writes ``bench_longrun.json`` and ``bench_longrun.md`` under ``--out``; ``--plot`` draws
write cost against restore read for every result of the given JSON files.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import cnrstore  # noqa: E402
from benches.measure import disk_bytes, evict_page_cache, timed  # noqa: E402
from benches.workload import Workload, apply_update, make_tables  # noqa: E402
from cnrstore.core import chainpolicy, grouppolicy  # noqa: E402
from cnrstore.format.blocks import KIND_BLOCK_LIST  # noqa: E402
from cnrstore.format.load import load_step, load_table_manifest  # noqa: E402
from cnrstore.format.rowlists import read_list  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of all tables together")
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.05])
    p.add_argument("--quant", nargs="+", default=["exact", "int8"])
    p.add_argument("--max-chain", type=int, nargs="+", default=[None],
                   help="max_chain settings (default: the store's default)")
    p.add_argument("--block-rows", type=int, default=None)
    p.add_argument("--budget", nargs="+", default=[None], metavar="LO:HI",
                   help="chain budget ranges, shares of a block's bytes (default: the policy's)")
    p.add_argument("--merge-share", type=float, default=None,
                   help="largest merged patch, share of the chain budget (default: the policy's)")
    p.add_argument("--reopen-every", type=int, default=0,
                   help="close and reopen the store every N steps (a restarted job)")
    p.add_argument("--layout", nargs="+", default=[None],
                   help="block layouts (Options.layout: chains, grouped; default the store's)")
    p.add_argument("--delta-share", type=float, default=None,
                   help="grouped layout: write a list whole once its delta passes this "
                        "share of its base (core/grouppolicy.py DELTA_SHARE; a what-if)")
    p.add_argument("--read-target", type=float, default=None,
                   help="grouped layout: the share of a block its listed bytes are cleaned "
                        "back to (core/grouppolicy.py READ_TARGET, a what-if like --budget)")
    p.add_argument("--time-restore", action="store_true",
                   help="time get_tables of the last step, warm (best of 3) and cold "
                        "(the store's files evicted, best of 2)")
    p.add_argument("--time-puts", action="store_true",
                   help="non-blocking puts with touched rows, stall and put timed, and "
                   "torch.save + fsync every --peer-every steps as the peer")
    p.add_argument("--peer-every", type=int, default=15,
                   help="steps between the peer's timed saves (with --time-puts)")
    p.add_argument("--label", default="", help="name of this code version in the plot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny tables, few steps")
    p.add_argument("--plot", default=None, help="write a PNG from the JSON files given")
    p.add_argument("inputs", nargs="*", help="bench_longrun.json files to plot")
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.steps, a.block_rows = 4096, 12, a.block_rows or 256
    if a.steps < 1 or a.rows < a.tables or a.tables < 1:
        p.error("need --steps >= 1 and --rows >= --tables >= 1")
    if a.peer_every < 1 or (a.time_puts and a.peer_every > a.steps):
        p.error("need 1 <= --peer-every <= --steps")
    if a.plot and not a.inputs:
        p.error("--plot needs bench_longrun.json files")
    try:
        a.budget = [None if b is None else tuple(float(v) for v in b.split(":"))
                    for b in a.budget]
    except ValueError:
        p.error("--budget takes LO:HI, e.g. 0.5:1")
    if any(b is not None and (len(b) != 2 or not 0 < b[0] <= b[1]) for b in a.budget):
        p.error("--budget takes LO:HI with 0 < LO <= HI")
    return a


def restore_bytes(store, step: int, closure: bool = False) -> tuple[int, int]:
    """(stored bytes of every object a restore of ``step`` reads, its tables' bytes):
    the step's closure but the objects only a grouped delta's base still names (dropped
    from the version, kept for gc, never read); with ``closure``, the whole closure."""
    objects = store.objects
    _, node = load_step(objects, step)
    found = objects.locate_closure(list(node.table_ids))
    read = sum(loc.length for loc in found.values())
    table = 0
    listed: set[bytes] = set()
    dropped: set[bytes] = set()
    for tid in node.table_ids:
        tm = load_table_manifest(objects, tid)
        tn = tm.node
        table += tn.rows * tn.row_nbytes
        for b in set(tm.block_ids):
            if not closure and found[b].kind == KIND_BLOCK_LIST:
                entries = read_list(objects.get, b)
                listed.update(entries.refs)
                dropped.update(set(entries.base_refs) - set(entries.refs))
    read -= sum(found[o].length for o in dropped - listed)
    return read, table


def run_one(args: argparse.Namespace, fraction: float, quant: str, max_chain: int | None,
            budget: tuple[float, float] | None = None, layout: str | None = None) -> dict:
    saved = chainpolicy.BUDGET_RANGE, chainpolicy.MERGE_SHARE
    target, share = grouppolicy.READ_TARGET, grouppolicy.DELTA_SHARE
    if args.delta_share is not None:
        grouppolicy.DELTA_SHARE = args.delta_share
    if args.read_target is not None:
        grouppolicy.READ_TARGET = args.read_target
    if budget is not None:
        chainpolicy.BUDGET_RANGE = budget
    if args.merge_share is not None:
        chainpolicy.MERGE_SHARE = args.merge_share
    try:
        return _run_one(args, fraction, quant, max_chain, layout)
    finally:
        chainpolicy.BUDGET_RANGE, chainpolicy.MERGE_SHARE = saved
        grouppolicy.READ_TARGET, grouppolicy.DELTA_SHARE = target, share


def _restore_times(store, path: Path, step: int) -> dict:
    """Seconds of get_tables(step): warm (best of 3) and cold (files evicted, best of 2)."""
    store.get_tables(step)
    warm = min(timed(lambda: store.get_tables(step))[0] for _ in range(3))
    cold = []
    for _ in range(2):
        evict_page_cache(path)
        cold.append(timed(lambda: store.get_tables(step))[0])
    return {"restore_warm_s": warm, "restore_cold_s": min(cold)}


def _objects_listed(store, step: int) -> int:
    """The most objects a block of ``step`` reads: its list, or its chain's depth + 1."""
    objects = store.objects
    _, node = load_step(objects, step)
    most = 0
    for tid in node.table_ids:
        tm = load_table_manifest(objects, tid)
        most = max([most, *(d + (objects.info(b).kind != KIND_BLOCK_LIST)
                            for b, d in zip(tm.block_ids, tm.depth))])
    return most


def _run_one(args: argparse.Namespace, fraction: float, quant: str, max_chain: int | None,
             layout: str | None = None) -> dict:
    work = Workload(fraction, "zipf")
    path = Path(args.out) / (f"store-{work.name}-{quant}-{max_chain}-"
                             f"{chainpolicy.BUDGET_RANGE}-{layout}")
    shutil.rmtree(path, ignore_errors=True)
    per = args.rows // args.tables
    tables = make_tables({f"t{i}": (per, args.dim) for i in range(args.tables)}, seed=args.seed)
    opts: dict = {}
    if max_chain is not None:
        opts["max_chain"] = max_chain
    if args.block_rows:
        opts["block_rows"] = args.block_rows
    if layout is not None:
        opts["layout"] = layout
    store = cnrstore.open(path, **opts)
    timing = PutTiming(Path(args.out) / f"peer-{work.name}-{quant}") if args.time_puts else None
    try:
        store.put_tables(0, tables, quant=quant)
        _, table_bytes = restore_bytes(store, 0)
        rnb = table_bytes // (per * args.tables)
        before = disk_bytes(path)
        wrote, raw = [], []
        for step in range(1, args.steps + 1):
            touched: dict = {}
            apply_update(tables, work, seed=args.seed, step=step, touched=touched)
            if args.reopen_every and step % args.reopen_every == 0:
                store.close()  # the next put seeds its diff base from the store
                store = cnrstore.open(path, **opts)
            if timing is None:
                info = store.put_tables(step, tables, quant=quant)
            else:
                info = timing.put(store, step, tables, quant, touched)
                if step % args.peer_every == 0:
                    timing.peer(step, tables)
            now = disk_bytes(path)
            wrote.append(now - before)
            raw.append(sum(info.rows_changed.values()) * rnb)
            before = now
        reads = [restore_bytes(store, s)[0] / table_bytes for s in range(args.steps + 1)]
        closures = [restore_bytes(store, s, closure=True)[0] / table_bytes
                    for s in range(args.steps + 1)]
        used = store.options.max_chain
        used_layout = store.options.layout
        listed = _objects_listed(store, args.steps)
        times = _restore_times(store, path, args.steps) if args.time_restore else {}
    finally:
        store.close()
        if timing is not None:
            timing.close()
    shutil.rmtree(path, ignore_errors=True)
    if timing is not None:
        times.update(timing.summary(min(45, args.steps)))
    med = statistics.median(wrote)
    first = min(45, len(wrote))
    tail_med = statistics.median(wrote[-first:])
    return {
        "label": args.label or used_layout, "layout": used_layout,
        "read_target": grouppolicy.READ_TARGET, "delta_share": grouppolicy.DELTA_SHARE,
        "objects_per_block": listed, **times,
        "reopen_every": args.reopen_every, "workload": work.name,
        "quant": quant, "max_chain": used,
        "budget": list(chainpolicy.BUDGET_RANGE), "merge_share": chainpolicy.MERGE_SHARE,
        "rows": per * args.tables, "steps": args.steps, "row_nbytes": rnb,
        "amortized": sum(wrote) / sum(raw),
        "amortized_45": sum(wrote[:first]) / sum(raw[:first]),
        "amortized_last45": sum(wrote[-first:]) / sum(raw[-first:]),
        # the last 45 of the first 150 and 300 steps, where the run went that far (1%'s
        # figure of record is at 300: its first 150 steps hold the first cleaning wave)
        "amortized_last45_at": {str(e): sum(wrote[e - first:e]) / sum(raw[e - first:e])
                                for e in (150, 300) if e < len(wrote)},
        "max_over_median": max(wrote) / med if med else float("inf"),
        "max_over_median_last45": max(wrote[-first:]) / tail_med if tail_med else float("inf"),
        "max_restore_read_last45": max(reads[-first:]),
        "max_restore_read": max(reads), "last_restore_read": reads[-1],
        "max_closure": max(closures), "max_closure_last45": max(closures[-first:]),
        "closure": closures,
        "step_bytes": wrote, "raw_bytes": raw, "restore_read": reads,
    }


class PutTiming:
    """``--time-puts``: each put's stall and time, and the peer's saves (torch.save +
    fsync both ways, benches/peers.py) under ``root`` (removed at the end)."""

    def __init__(self, root: Path) -> None:
        from benches.peers import TorchSave

        shutil.rmtree(root, ignore_errors=True)
        self.root = root
        self.save = TorchSave(root / "keep")
        self.stall: list[float] = []
        self.put_s: list[float] = []
        self.peers: list[dict] = []

    def put(self, store, step: int, tables: dict, quant: str, touched: dict):
        import torch

        ids = {k: torch.from_numpy(v) for k, v in touched.items()}
        stall, fut = timed(lambda: store.put_tables(step, tables, quant=quant,
                                                    blocking=False, touched=ids))
        wait, info = timed(fut.result)
        self.stall.append(stall)
        self.put_s.append(stall + wait)
        return info

    def peer(self, step: int, tables: dict) -> None:
        got = self.save.put(step, tables)
        self.peers.append({"step": step, "keep_s": got["put_keep_s"],
                           "replace_s": got["put_replace_s"], "peer_s": got["put_s"]})
        for f in self.save.root.glob("step_*.pt"):  # bytes on disk bounded; times kept
            f.unlink()

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)  # both ways' files lie under it

    def summary(self, last: int) -> dict:
        peer = statistics.median(p["peer_s"] for p in self.peers) if self.peers else None
        tail_stall, tail_put = self.stall[-last:], self.put_s[-last:]
        out: dict = {"stall_s": self.stall, "put_s": self.put_s, "torch_save": self.peers,
                     "peer_s": peer,
                     "stall_mean_last45_s": statistics.fmean(tail_stall),
                     "stall_max_last45_s": max(tail_stall),
                     "put_mean_last45_s": statistics.fmean(tail_put),
                     "put_max_last45_s": max(tail_put)}
        if peer:
            out.update({k[:-2] + "_x": v / peer for k, v in list(out.items())
                        if k.endswith("last45_s")})
        return out


def markdown(results: list[dict]) -> str:
    lines = ["| code | workload | scheme | max_chain | budget | steps | write/raw "
             "| write/raw (first 45) | write/raw (last 45) | max/median step "
             "| max/median (last 45) | max restore read | objects / block (last step) "
             "| restore warm / cold (s) | max closure | write/raw (last 45 of 150 / 300) "
             "| stall mean / max, put mean (last 45) / torch.save |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        budget = ":".join(f"{v:g}" for v in r.get("budget", (0.5, 1.0)))
        if r.get("merge_share", 0.5) != 0.5:
            budget += f" m{r['merge_share']:g}"
        last = r.get("amortized_last45", float("nan"))
        last_spike = r.get("max_over_median_last45", float("nan"))
        lines.append(
            f"| {r['label']} | {r['workload']} | {r['quant']} | {r['max_chain']} | {budget} "
            f"| {r['steps']} | {r['amortized']:.2f}x | {r['amortized_45']:.2f}x | {last:.2f}x "
            f"| {r['max_over_median']:.1f}x | {last_spike:.1f}x "
            f"| {r['max_restore_read']:.2f}x | {r.get('objects_per_block', '-')} "
            f"| {_times(r)} | {_closure(r)} | {_at(r)} | {_stall(r)} |")
    return "\n".join(lines) + "\n"


def _stall(r: dict) -> str:
    if "stall_mean_last45_x" not in r:
        return "-"
    return (f"{r['stall_mean_last45_x']:.3f}x / {r['stall_max_last45_x']:.3f}x, "
            f"{r['put_mean_last45_x']:.3f}x of {r['peer_s']:.2f} s")


def _at(r: dict) -> str:
    at = dict(r.get("amortized_last45_at", {}))
    if r["steps"] in (150, 300):
        at[str(r["steps"])] = r["amortized_last45"]
    return " / ".join(f"{at[k]:.3f}x" if k in at else "-" for k in ("150", "300"))


def _closure(r: dict) -> str:
    return f"{r['max_closure']:.2f}x" if "max_closure" in r else "-"


def _times(r: dict) -> str:
    if "restore_warm_s" not in r:
        return "-"
    return f"{r['restore_warm_s']:.2f} / {r['restore_cold_s']:.2f}"


def plot(out: str, inputs: list[str]) -> None:
    """Write cost (the last 45 steps where the JSON has them) against the largest restore
    read, one line per workload and scheme through its budget settings."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - ScalarFormatter below

    results = [r for f in inputs for r in json.loads(Path(f).read_text())["results"]]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    marks = {"exact": "o", "int8": "s"}
    colors = {"zipf-1pct": "tab:blue", "zipf-5pct": "tab:red"}
    lines: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        lines.setdefault((r["workload"], r["quant"]), []).append(r)
    for (work, quant), rs in sorted(lines.items()):
        rs.sort(key=lambda r: r.get("budget", (0.5, 1.0))[0])
        xs = [r.get("amortized_last45", r["amortized"]) for r in rs]
        ys = [r["max_restore_read"] for r in rs]
        color = colors.get(work, "tab:grey")
        ax.plot(xs, ys, color=color, lw=0.8, marker=marks.get(quant, "x"),
                label=f"{work} {quant}", ls="-" if quant == "exact" else "--")
        for r, x, y in zip(rs, xs, ys):
            budget = ":".join(f"{v:g}" for v in r.get("budget", (0.5, 1.0)))
            spike = r.get("max_over_median_last45", r["max_over_median"])
            ax.annotate(f"{budget} ({spike:.1f}x)", (x, y), textcoords="offset points",
                        xytext=(4, 3), fontsize=7, color=color)
    ax.axvline(1.5, color="grey", lw=0.5, ls="--")
    ax.axhline(1.5, color="grey", lw=0.5, ls="--")
    ax.fill_between([1.0, 1.5], 1.0, 1.5, color="tab:green", alpha=0.08, label="target")
    ax.set_xlim(1.0, max(3.2, max(ax.get_xlim())))
    ax.set_ylim(1.0, max(1.9, max(ax.get_ylim())))
    ax.legend(fontsize=7, loc="upper right")
    ax.set_xlabel("bytes written on disk per step / changed rows' bytes (last 45 steps)")
    ax.set_ylabel("largest restore read / table bytes (any kept step)")
    steps = sorted({r["steps"] for r in results})
    ax.set_title(f"Long run, {'/'.join(map(str, steps))} steps: write vs restore read over "
                 "chain budget ranges\n(labels: budget share of a block (largest / median "
                 "step, last 45))", fontsize=9)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.inputs)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for fraction in args.fractions:
        for quant in args.quant:
            for mc in args.max_chain:
                for budget in args.budget:
                    for layout in args.layout:
                        r = run_one(args, fraction, quant, mc, budget, layout)
                        results.append(r)
                        print(markdown([r]).splitlines()[-1], flush=True)
    (out / "bench_longrun.json").write_text(json.dumps({"results": results}, indent=1))
    (out / "bench_longrun.md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

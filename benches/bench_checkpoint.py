"""Side-by-side checkpoint benchmark: cnrstore against torch.save, safetensors and DCP.

Every system checkpoints the same DLRM-like tables (benches/workload.py) through one full
and several incremental steps per workload, each system in a subprocess of its own
(benches/worker.py) so its memory peak is its own. Results: medians of ``--repeat`` runs,
ratios against torch.save, a Markdown table, a JSON file and (with matplotlib) PNG plots
in ``--out``.

    .venv/bin/python benches/bench_checkpoint.py --out bench_out            # >= 1 GiB
    .venv/bin/python benches/bench_checkpoint.py --quick --out /tmp/q        # < 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `benches` importable
    sys.path.insert(0, str(REPO))

from benches import report  # noqa: E402
from benches.peers import BASELINES, SYSTEMS, available_systems  # noqa: E402
from benches.workload import DISTRIBUTIONS, Workload, table_specs  # noqa: E402

__all__ = ["main", "parse_args"]

QUICK_SCALE = 0.002  # 8.4 k rows, 2.2 MB: smoke-test size


def _csv(kind):
    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="results directory")
    p.add_argument("--scale", type=float, default=None,
                   help="multiplies every table's rows (1.0 = 1.075 GB fp32)")
    p.add_argument("--steps", type=int, default=None, help="incremental steps after the full")
    p.add_argument("--fractions", type=_csv(float), default=[0.01, 0.05, 0.2],
                   help="fractions of rows changed per interval")
    p.add_argument("--dists", type=_csv(str), default=list(DISTRIBUTIONS))
    p.add_argument("--systems", type=_csv(str), default=None,
                   help=f"subset of {','.join(SYSTEMS)} (default: all available)")
    p.add_argument("--repeat", type=int, default=None, help="runs per job; medians are reported")
    p.add_argument("--seed", type=int, default=0)
    # One intra-op thread by default: on a loaded 2-core machine OpenMP workers spin against
    # each other and other users' processes, which made cnrstore's int8 encode 20x slower
    # (measured, docs/PERFORMANCE.md). Pass 0 for torch's default on a quiet machine.
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per job (0: torch's default)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where stores are written (default: a temp dir under --out)")
    p.add_argument("--drop-caches", action="store_true",
                   help="try /proc/sys/vm/drop_caches before restores (root; whole machine)")
    p.add_argument("--baselines-per-workload", action="store_true",
                   help="measure baselines on every workload (default: the first only)")
    p.add_argument("--job-timeout", type=float, default=1800.0, help="seconds per job")
    p.add_argument("--one-process", action="store_true",
                   help="run all jobs of a repeat in one subprocess (implied by --quick)")
    p.add_argument("--plot", type=Path, default=None,
                   help="also draw restore time per system into this PNG (with results.json "
                        "files as arguments: draw from them, run nothing)")
    p.add_argument("inputs", nargs="*", type=Path, help="results.json files for --plot")
    p.add_argument("--quick", action="store_true",
                   help=f"CI smoke run: scale {QUICK_SCALE}, 2 incremental steps, 1 repeat, "
                        "one process")
    args = p.parse_args(argv)
    if args.inputs and not args.plot:
        p.error("results.json arguments need --plot")
    args.one_process = args.one_process or args.quick
    args.scale = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 1.0)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 3)
    args.repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    # Validate everything before any job runs or anything is written.
    if args.scale <= 0:
        p.error(f"--scale must be > 0, got {args.scale}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1 (one incremental step at least), got {args.steps}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    try:
        args.workloads = [Workload(f, d) for d in args.dists for f in args.fractions]
    except ValueError as exc:
        p.error(str(exc))
    available = available_systems()
    if args.systems is None:
        args.systems = list(available)
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    missing = [s for s in args.systems if s not in available]
    if missing:
        p.error(f"systems {missing} need a package that is not installed")
    return args


def _run_worker(specs: list[dict[str, Any]], tmp: Path, timeout: float) -> list[dict[str, Any]]:
    spec_path, result_path = tmp / "specs.json", tmp / "results.json"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(specs))
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=pythonpath)
    names = ",".join(s["system"] for s in specs)
    proc = subprocess.run(
        [sys.executable, "-m", "benches.worker", str(spec_path), str(result_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout * len(specs),
    )
    if proc.returncode != 0 or not result_path.exists():
        raise RuntimeError(f"job {names} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(result_path.read_text())


def _jobs(args: argparse.Namespace) -> list[tuple[str, list[Workload]]]:
    """(system, workloads) per job. Apart from --one-process, every workload gets a process
    of its own: memory a job's allocator kept from an earlier workload would otherwise be
    resident already and hide part of the next workload's peak."""
    all_w = args.workloads
    jobs = []
    for s in args.systems:
        ws = all_w if (s not in BASELINES or args.baselines_per_workload) else all_w[:1]
        jobs += [(s, ws)] if args.one_process else [(s, [w]) for w in ws]
    return jobs


def _baseline_first(workloads: list[Workload]) -> list[Workload]:
    # Baselines run on the first workload only: put the target workload first if present.
    target = [w for w in workloads if w.name == report.TARGET_WORKLOAD]
    return target + [w for w in workloads if w.name != report.TARGET_WORKLOAD]


CLI_COMMANDS = (("python -c pass", None), ("cnrstore --help", ["--help"]),
                ("cnrstore ls", ["ls", "{store}"]),
                ("cnrstore show", ["show", "{store}", "2"]),
                ("cnrstore du", ["du", "{store}"]),
                ("cnrstore diff", ["diff", "{store}", "1", "2"]),
                ("cnrstore verify --shallow", ["verify", "{store}", "--shallow"]))


def cli_startup(tmp: Path, runs: int = 5) -> dict[str, Any]:
    """Median wall seconds of the read-only CLI commands on a small 2-step store, next to
    ``python -c pass`` (the peer: an interpreter that does nothing), and whether each
    imported torch (it must not)."""
    import torch

    import cnrstore

    store = tmp / "cli-store"
    with cnrstore.open(store) as s:
        t = torch.randn(20000, 64, generator=torch.Generator().manual_seed(0))
        s.put_tables(1, {"t": t})
        t[::50] += 1
        s.put_tables(2, {"t": t})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO),
                                                       os.environ.get("PYTHONPATH", "")]))
    probe = ("import sys\nfrom cnrstore.cli.app import main\ntry:\n    main(sys.argv[1:])\n"
             "except SystemExit:\n    pass\n"
             "sys.stderr.write('TORCH=%d' % ('torch' in sys.modules))")
    out: dict[str, Any] = {}
    for name, argv in CLI_COMMANDS:
        cmd = ([sys.executable, "-c", "pass"] if argv is None else
               [sys.executable, "-c", probe, *(a.format(store=store) for a in argv)])
        times, torch_seen = [], False
        for _ in range(runs):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True,
                                  timeout=120)
            times.append(time.perf_counter() - t0)
            torch_seen |= "TORCH=1" in proc.stderr
        out[name] = {"median_s": sorted(times)[len(times) // 2], "imports_torch": torch_seen}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.workloads = _baseline_first(args.workloads)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = table_specs(scale=args.scale)
    with tempfile.TemporaryDirectory(prefix="cnrbench-", dir=args.workdir or args.out) as tmp:
        tmp = Path(tmp)
        base = {"tables": specs, "seed": args.seed, "steps": args.steps,
                "threads": args.threads, "drop_caches": args.drop_caches,
                "workdir": str(tmp / "stores")}
        fingerprint: dict[str, Any] = {}
        runs: dict[str, list[dict[str, Any]]] = {}
        failures: list[dict[str, Any]] = []
        for rep in range(args.repeat):
            rep_runs: dict[str, dict[str, Any]] = {}
            jobs = [{**base, "system": system,
                     "workloads": [[w.fraction, w.dist] for w in workloads]}
                    for system, workloads in _jobs(args)]
            if rep == 0:
                jobs.insert(0, {**base, "system": "fingerprint"})
            batches = [jobs] if args.one_process else [[j] for j in jobs]
            for batch in batches:
                t0 = time.perf_counter()
                names = ",".join(s["system"] for s in batch)
                try:
                    results = _run_worker(batch, tmp, args.job_timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    # One broken system must not hide the others' figures: record, go on.
                    failures.append({"repeat": rep, "jobs": names, "error": str(exc)[-4000:]})
                    print(f"[{rep + 1}/{args.repeat}] {names}: FAILED\n{exc}", file=sys.stderr)
                    continue
                for result in results:
                    if result.get("system") is None:
                        fingerprint = result
                        continue
                    agg = rep_runs.setdefault(result["system"], {**result, "workloads": {},
                                                                 "job_s": 0.0})
                    agg["workloads"].update(result["workloads"])
                    agg["job_s"] += result["job_s"]
                done = ",".join(f"{j['system']}:{Workload(*j['workloads'][0]).name}"
                                if len(j.get("workloads", ())) == 1 else j["system"]
                                for j in batch)
                print(f"[{rep + 1}/{args.repeat}] {done}: {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
            for system, agg in rep_runs.items():
                runs.setdefault(system, []).append(agg)
        # --quick is the CI smoke run: one start-up a command shows the columns work
        cli = cli_startup(tmp, runs=1 if args.quick else 5)
    if not runs:
        raise RuntimeError(f"every job failed: {failures}")
    merged = {system: report.median_merge(results) for system, results in runs.items()}
    summary = report.summarize(merged)
    checks = report.check_targets(summary)
    first = next(iter(next(iter(merged.values()))["workloads"].values()))
    meta = {
        "scale": args.scale, "steps": args.steps, "repeat": args.repeat, "seed": args.seed,
        "tables": specs, "n_tables": len(specs), "logical_mb": first["logical_bytes"] / 1e6,
        "workloads": [w.name for w in args.workloads], "systems": args.systems,
        "baselines_per_workload": args.baselines_per_workload,
        "cache_eviction": first["cache_eviction"],
        "memory_method": next(iter(merged.values()))["memory_method"], "threads": args.threads,
        "one_process": args.one_process,
        "fingerprint": fingerprint, "cli_startup": cli, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    import torch  # only for the version: the jobs did the work

    meta["torch"] = torch.__version__
    meta["plots"] = report.plot(summary, args.out)
    if args.plot:
        report.plot_restores(summary, args.plot)
        meta["plots"].append(str(args.plot))
    doc = {"meta": meta, "summary": summary, "targets": checks, "runs": runs,
           "failures": failures}
    md = report.markdown(summary, checks, meta)
    if failures:
        md += "\n## Failed jobs\n\n" + "\n".join(
            f"- repeat {f['repeat'] + 1}, {f['jobs']}: `{f['error'].splitlines()[-1]}`"
            for f in failures) + "\n"
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    (args.out / "results.md").write_text(md)
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.inputs:
        for path in args.inputs:  # one PNG per file would overwrite: the last one wins
            report.plot_restores(json.loads(path.read_text())["summary"], args.plot)
        return 0
    doc = run(args)
    print((args.out / "results.md").read_text())
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""int8 / int4 / int3 / int2 side by side: encode throughput, incremental put and L2 error.

All schemes checkpoint the same DLRM-like tables (benches/workload.py) with the same row
updates, in one process, next to torch.save + fsync of the same tables. Each cnrstore run
is repeated with the two range searches of int4/int3/int2 (their
default): "numpy" (the current one) and "torch" (the torch walk CPUs ran before, still the
CUDA path), so the before/after figures come from one run on one machine state. int8 uses
min/max either way. Reported per scheme and search implementation:

- encode MB/s: encode_rows of the rows the first update changed (fp32 bytes in), per
  second of wall time and per CPU-second of the process (all its threads);
- incremental put: median seconds of `--steps` blocking puts after the full put, as a
  ratio to int8's (same implementation) and to torch.save + fsync;
- relative L2 error of those rows: ||decode(encode(x)) - x|| / ||x||.

    .venv/bin/python benches/bench_quant.py --scale 0.2 --out bench_out/quant   # 215 MB
    .venv/bin/python benches/bench_quant.py --quick --out /tmp/q                 # seconds
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `benches` importable
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benches.peers import TorchSave  # noqa: E402
from benches.workload import (  # noqa: E402
    Workload,
    apply_update,
    changed_rows,
    make_tables,
    table_specs,
)

__all__ = ["main", "parse_args", "run"]

SCHEMES = ("int8", "int4", "int3", "int2")
IMPLS = ("grid", "greedy")
QUICK_SCALE = 0.002


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench_out/quant"))
    p.add_argument("--scale", type=float, default=None,
                   help="multiplies the tables' rows (1.0 = 1.075 GB fp32; default 0.2)")
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--dist", default="zipf", choices=("zipf", "uniform"))
    p.add_argument("--steps", type=int, default=None, help="incremental puts (median)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="range searches to run: grid (now), greedy (before)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's default); see bench_checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"smoke run: scale {QUICK_SCALE}")
    args = p.parse_args(argv)
    args.scale = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 0.2)
    args.steps = args.steps if args.steps is not None else (1 if args.quick else 3)
    args.impls = [s for s in args.impls.split(",") if s]
    if args.scale <= 0 or args.steps < 1:
        p.error("--scale must be > 0 and --steps >= 1")
    if not args.impls or any(i not in IMPLS for i in args.impls):
        p.error(f"--impls must be a subset of {','.join(IMPLS)}")
    return args


def _changed_sample(tables: dict[str, torch.Tensor], workload: Workload, seed: int):
    """The rows the first update changes, concatenated over the tables (after it)."""
    parts = []
    for i, t in enumerate(tables.values()):
        ids = changed_rows(t.shape[0], workload, seed=seed, step=1, table_index=i)
        parts.append(t[torch.from_numpy(ids)])
    return torch.cat(parts)


def _encode_and_error(rows: torch.Tensor, scheme: str) -> tuple[float, float]:
    from cnrstore.codec.quantize import decode_rows, encode_rows

    encode_rows(rows[:64], scheme)  # warm-up: first-call costs are not throughput
    c0, t0 = time.process_time(), time.perf_counter()
    codes = encode_rows(rows, scheme)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    back = decode_rows(codes, scheme, rows.dtype, rows.shape[1])
    err = (back.double() - rows.double()).norm() / rows.double().norm()
    return rows.nbytes / 1e6 / seconds, rows.nbytes / 1e6 / cpu, float(err)


def _puts(system, args, workload: Workload, specs) -> dict[str, Any]:
    tables = make_tables(specs, seed=args.seed)
    full_s = system.put(0, tables)["put_s"]
    incr = []
    for step in range(1, args.steps + 1):
        apply_update(tables, workload, seed=args.seed, step=step)
        incr.append(system.put(step, tables)["put_s"])
    system.close()
    return {"full_put_s": full_s, "incr_put_s": statistics.median(incr), "incr_runs_s": incr}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benches.peers import CnrStore
    from cnrstore.codec import quantize

    if args.threads:
        torch.set_num_threads(args.threads)
    workload = Workload(args.fraction, args.dist)
    specs = table_specs(scale=args.scale)
    tables = make_tables(specs, seed=args.seed)
    logical_mb = sum(t.nbytes for t in tables.values()) / 1e6
    apply_update(tables, workload, seed=args.seed, step=1)
    sample = _changed_sample(tables, workload, args.seed)
    del tables
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cnrquant-", dir=args.out))
    results: dict[str, Any] = {}
    saved = quantize.LOW_BITS_SEARCH
    try:
        peer = _puts(TorchSave(work / "torch_save"), args, workload, specs)
        shutil.rmtree(work / "torch_save")
        # Implementations alternate per scheme, so both see about the same machine load.
        for scheme in SCHEMES:
            for impl in args.impls:
                quantize.LOW_BITS_SEARCH = impl
                print(f"{impl} {scheme} ...", file=sys.stderr, flush=True)
                mbps, mb_cpu_s, err = _encode_and_error(sample, scheme)
                root = work / f"{impl}_{scheme}"
                puts = _puts(CnrStore(root, scheme=scheme, blocking=True, use_touched=False),
                             args, workload, specs)
                shutil.rmtree(root)
                results[f"{impl}/{scheme}"] = {"impl": impl, "scheme": scheme,
                                               "encode_mb_s": mbps,
                                               "encode_mb_per_cpu_s": mb_cpu_s,
                                               "rel_l2_error": err,
                                               **puts}
    finally:
        quantize.LOW_BITS_SEARCH = saved
        shutil.rmtree(work, ignore_errors=True)
    for r in results.values():
        int8 = results[f"{r['impl']}/int8"]["incr_put_s"]
        r["incr_put_vs_int8"] = r["incr_put_s"] / int8
        r["incr_put_vs_torch_save"] = r["incr_put_s"] / peer["incr_put_s"]
    return {"meta": {"scale": args.scale, "logical_mb": logical_mb, "workload": workload.name,
                     "steps": args.steps, "sample_mb": sample.nbytes / 1e6,
                     "threads": args.threads, "seed": args.seed},
            "torch_save": peer, "results": results}


def markdown(report: dict[str, Any]) -> str:
    m, peer = report["meta"], report["torch_save"]
    lines = [
        f"{m['logical_mb']:.0f} MB of fp32 tables, {m['workload']} per interval, median of "
        f"{m['steps']} incremental puts; encode and error on the {m['sample_mb']:.1f} MB of "
        f"changed rows. torch.save+fsync: {peer['incr_put_s']:.3f} s.",
        "",
        "| scheme | search (CPU) | encode MB/s | MB/CPU-s | incr. put s | x int8 "
        "| x torch.save | rel. L2 error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(report["results"].values(), key=lambda r: IMPLS.index(r["impl"])):
        lines.append(
            f"| {r['scheme']} | {r['impl']} | {r['encode_mb_s']:.1f} "
            f"| {r['encode_mb_per_cpu_s']:.1f} | {r['incr_put_s']:.3f} "
            f"| {r['incr_put_vs_int8']:.2f} | {r['incr_put_vs_torch_save']:.2f} "
            f"| {r['rel_l2_error']:.6g} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    (args.out / "bench_quant.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / "bench_quant.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

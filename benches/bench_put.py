"""The write side of issue 27, against torch.save+fsync measured in the same run.

    .venv/bin/python benches/bench_put.py --out /tmp/put             # 4 tables, 461 MB fp32
    .venv/bin/python benches/bench_put.py --quick --out /tmp/put-q   # smoke, seconds

Per repeat, in a fresh process (benches/worker-like, so no repeat inherits another's page
cache state or allocator): the tables of benches/workload.py (the first ``--tables`` of
them at ``--scale``; 5% Zipf changed rows per step), a full put and ``--steps``
incremental puts of each system, the systems taking turns at every step on the same
tables:

- torch_save: torch.save+fsync both ways (benches/peers.py TorchSave: a file kept per
  step, one file replaced per step); the faster of the two is the peer;
- cnr_int8_async: put_tables(blocking=False): the stall (until it returns) and the put
  (until the step is durable);
- cnr_int8, cnr_exact: blocking puts.

Then, each in a fresh interpreter, the first put of a process (exact, into a new store)
from just after the tables exist: cnrstore's import, open and put, against torch.save+fsync
of the same tables in another fresh interpreter (the replace way has no file to replace
yet, so it is the keep way). And the fingerprint pass (all tables, one core and all
cores) against a plain uint64-multiply pass and a read pass over the same bytes (numpy,
one core), with the numpy fallback path beside it.

Figures are medians over steps and repeats; ratios are taken inside each repeat first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SYSTEMS = ("torch_save", "cnr_int8_async", "cnr_int8", "cnr_exact")

_FRESH = r"""
import json, os, sys, time
t_start = time.perf_counter()
import torch
sys.path.insert(0, {repo!r})
from benches.workload import make_tables
torch.set_num_threads({threads})
tables = make_tables({specs!r}, seed=0)
t_import_torch_and_tables = time.perf_counter() - t_start
out = {{}}
t0 = time.perf_counter()
if {which!r} == "torch_save":
    with open({path!r}, "wb") as f:
        torch.save(tables, f); f.flush(); os.fsync(f.fileno())
    fd = os.open(os.path.dirname({path!r}), os.O_RDONLY); os.fsync(fd); os.close(fd)
else:
    import cnrstore
    out["import_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    store = cnrstore.open({path!r})
    out["open_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    store.put_tables(0, tables, quant="exact")
    out["put_s"] = time.perf_counter() - t2
    from cnrstore.codec import native
    out["native"] = native.status()["state"]
out["total_s"] = time.perf_counter() - t0
if {which!r} != "torch_save":
    t3 = time.perf_counter(); store.close(); out["close_s"] = time.perf_counter() - t3
print(json.dumps(out))
"""


def _specs(args) -> dict:
    from benches.workload import table_specs

    return dict(list(table_specs(scale=args.scale).items())[: args.tables])


def fresh_full_put(args, work: Path) -> dict:
    """One fresh interpreter per system, in alternating order; seconds from after the
    tables exist until the step is durable (cnrstore: its import, open and put)."""
    res: dict = {}
    # Bytecode cached, as in an installed package (this workplace sets
    # PYTHONDONTWRITEBYTECODE, which made every fresh import compile ~0.6 s of source).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=str(REPO), PYTHONPYCACHEPREFIX=str(work / "pycache"))
    subprocess.run([sys.executable, "-c", "import torch, cnrstore.core.store"], env=env,
                   check=True, timeout=600)
    order = ["cnr", "torch_save"] if args.rep % 2 == 0 else ["torch_save", "cnr"]
    for which in order:
        path = work / ("fresh.pt" if which == "torch_save" else "fresh-store")
        code = _FRESH.format(repo=str(REPO), threads=args.threads, specs=_specs(args),
                             which=which, path=str(path))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=1800, env=env)
        if proc.returncode:
            raise RuntimeError(f"fresh {which} failed:\n{proc.stderr[-3000:]}")
        res[which] = json.loads(proc.stdout.strip().splitlines()[-1])
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
    res["ratio"] = res["cnr"]["total_s"] / res["torch_save"]["total_s"]
    return res


def fingerprint_rates(tables: dict) -> dict:
    """GB/s of the fingerprint pass over all tables (kernel: one core, all cores; numpy
    path: all cores) and of numpy's uint64-multiply and read passes (one core)."""
    import numpy as np
    import torch

    from cnrstore.codec import fingerprint as fp_mod
    from cnrstore.codec import native

    total = sum(t.numel() * t.element_size() for t in tables.values())
    outs = {k: torch.empty(t.shape[0], dtype=torch.int64) for k, t in tables.items()}

    def best(fn, reps=3) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return total / min(times) / 1e9

    def fp_all() -> None:
        for k, t in tables.items():
            fp_mod.row_fingerprints(t, out=outs[k])

    buf = np.empty(1 << 14, dtype=np.uint64)
    c = np.uint64(0x9E3779B97F4A7C15)

    def mul_pass() -> None:  # the "plain uint64-multiply pass", cache-sized chunks
        for t in tables.values():
            w = t.reshape(-1).view(torch.int64).numpy().view(np.uint64)
            for s in range(0, w.size, buf.size):
                part = w[s:s + buf.size]
                np.multiply(part, c, out=buf[:part.size])

    def read_pass() -> None:
        for t in tables.values():
            w = t.reshape(-1).view(torch.int64).numpy().view(np.uint64)
            for s in range(0, w.size, 1 << 17):
                np.bitwise_xor.reduce(w[s:s + (1 << 17)])

    out = {"kernel": native.status()["state"], "mul_pass_gbs": best(mul_pass),
           "read_pass_gbs": best(read_pass), "fp_all_cores_gbs": best(fp_all)}
    split = fp_mod._SPLIT_MIN_BYTES
    fp_mod._SPLIT_MIN_BYTES = 1 << 62  # one core
    try:
        out["fp_one_core_gbs"] = best(fp_all)
    finally:
        fp_mod._SPLIT_MIN_BYTES = split
    real = native.kernel
    native.kernel = lambda **kw: None  # type: ignore[assignment]
    try:
        out["fp_numpy_all_cores_gbs"] = best(fp_all, reps=1)
    finally:
        native.kernel = real  # type: ignore[assignment]
    out["fp_one_core_vs_mul_pass"] = out["fp_one_core_gbs"] / out["mul_pass_gbs"]
    return out


def puts(args, work: Path) -> dict:
    """Full and incremental puts of every system, taking turns at every step."""
    import cnrstore
    from benches.peers import TorchSave
    from benches.workload import Workload, apply_update, make_tables

    tables = make_tables(_specs(args), seed=args.rep)
    workload = Workload(args.fraction, "zipf")
    peer = TorchSave(work / "torch_save")
    stores = {s: cnrstore.open(str(work / s)) for s in SYSTEMS[1:]}
    quant = {"cnr_int8_async": "int8", "cnr_int8": "int8", "cnr_exact": "exact"}
    rec: dict = {s: [] for s in SYSTEMS}
    for step in range(args.steps + 1):
        if step:
            apply_update(tables, workload, seed=args.rep, step=step)
        order = list(SYSTEMS) if step % 2 == 0 else list(SYSTEMS)[::-1]
        for system in order:
            if system == "torch_save":
                rec[system].append(peer.put(step, tables))
                continue
            store = stores[system]
            t0 = time.perf_counter()
            if system.endswith("_async"):
                fut = store.put_tables(step, tables, quant=quant[system], blocking=False)
                stall = time.perf_counter() - t0
                fut.result()
            else:
                store.put_tables(step, tables, quant=quant[system])
                stall = None
            put_s = time.perf_counter() - t0
            rec[system].append({"put_s": put_s, "stall_s": stall if stall else put_s})
    for s in stores.values():
        s.close()
    fp = fingerprint_rates(tables)
    return {"steps": rec, "fingerprint": fp}


def _ratios(rep: dict) -> dict:
    steps = rep["puts"]["steps"]
    ts = [s["put_s"] for s in steps["torch_save"]]
    out = {}
    for system in SYSTEMS[1:]:
        incr = steps[system][1:]
        out[system] = {
            "incr_put_ratio": statistics.median(s["put_s"] / t for s, t in zip(incr, ts[1:])),
            "stall_ratio": statistics.median(s["stall_s"] / t for s, t in zip(incr, ts[1:])),
            "full_put_ratio": steps[system][0]["put_s"] / ts[0],
        }
    return out


def run_repeat(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-put-", dir=args.workdir))
    try:
        rep = {"puts": puts(args, work), "fresh_full_put": fresh_full_put(args, work)}
        rep["ratios"] = _ratios(rep)
        return rep
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(doc: dict) -> str:
    reps = doc["repeats"]
    med = statistics.median
    m = doc["meta"]
    lines = [f"# bench_put ({m['time']}, load at start {m['load']})", "",
             f"`{m['command']}`", "",
             f"{m['logical_mb']:.0f} MB fp32 in {m['tables']} tables, {m['fraction']:.0%} Zipf "
             f"changed rows per step, {m['steps']} incremental steps, {len(reps)} repeats "
             f"(medians; ratios per step inside a repeat), torch threads {m['threads']}, "
             f"{m['cpus']} CPUs; fingerprint kernel: {reps[0]['puts']['fingerprint']['kernel']}.",
             "", "| system | incr put / ts | stall / ts | full put / ts (warm process) |",
             "|---|---|---|---|"]
    for system in SYSTEMS[1:]:
        r = [rep["ratios"][system] for rep in reps]
        lines.append(f"| {system} | {med(x['incr_put_ratio'] for x in r):.3f} "
                     f"| {med(x['stall_ratio'] for x in r):.3f} "
                     f"| {med(x['full_put_ratio'] for x in r):.3f} |")
    ts = [s for rep in reps for s in rep["puts"]["steps"]["torch_save"][1:]]
    lines += ["", f"torch.save+fsync per incremental step: kept per step "
              f"{med(s['put_keep_s'] for s in ts):.3f} s, replaced per step "
              f"{med(s['put_replace_s'] for s in ts):.3f} s (peer: the faster at each step; "
              f"keep won {sum(s['peer_way'] == 'keep' for s in ts)} of {len(ts)})."]
    for system in SYSTEMS[1:]:
        st = [s for rep in reps for s in rep["puts"]["steps"][system][1:]]
        lines.append(f"- {system}: incremental put {med(s['put_s'] for s in st):.3f} s, "
                     f"stall {med(s['stall_s'] for s in st):.3f} s")
    fr = [rep["fresh_full_put"] for rep in reps]
    c = {k: med(f["cnr"][k] for f in fr) for k in ("import_s", "open_s", "put_s", "total_s")}
    lines += ["", "First put of a fresh process (exact, new store; from after the tables exist):",
              f"cnrstore {c['total_s']:.3f} s (import {c['import_s']:.3f}, open "
              f"{c['open_s']:.3f}, put {c['put_s']:.3f}) against torch.save+fsync "
              f"{med(f['torch_save']['total_s'] for f in fr):.3f} s: "
              f"**{med(f['ratio'] for f in fr):.3f}x**.", ""]
    fp = [rep["puts"]["fingerprint"] for rep in reps]
    keys = ("mul_pass_gbs", "read_pass_gbs", "fp_one_core_gbs", "fp_all_cores_gbs",
            "fp_numpy_all_cores_gbs")
    lines += ["Fingerprint pass, GB/s over all tables: " + ", ".join(
        f"{k.removesuffix('_gbs')} {med(f[k] for f in fp):.2f}" for k in keys)
        + f"; one core / multiply pass: "
        f"{med(f['fp_one_core_vs_mul_pass'] for f in fp):.2f}x.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scale", type=float, default=0.44)
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rep", type=int, default=None, help=argparse.SUPPRESS)  # one repeat
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.steps, args.repeat = 0.005, 2, 1
    if args.steps < 1 or args.repeat < 1 or args.scale <= 0 or not 0 < args.fraction <= 1:
        p.error("need --steps >= 1, --repeat >= 1, --scale > 0, 0 < --fraction <= 1")
    import torch

    torch.set_num_threads(args.threads)
    if args.rep is not None:  # a child: one repeat, JSON on stdout
        print(json.dumps(run_repeat(args)))
        return 0
    from cnrstore.codec import native

    native.kernel(wait=True)  # build the kernel before any timed process needs it
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    reps = []
    for rep in range(args.repeat):
        cmd = [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:]),
               "--rep", str(rep)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        if proc.returncode:
            raise SystemExit(f"repeat {rep} failed:\n{proc.stderr[-4000:]}")
        reps.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"[{rep + 1}/{args.repeat}] done", file=sys.stderr, flush=True)
    specs = _specs(args)
    doc = {"meta": {"command": "benches/bench_put.py " + " ".join(argv or sys.argv[1:]),
                    "time": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
                    "load": load, "cpus": os.cpu_count(), "machine": platform.machine(),
                    "tables": len(specs), "threads": args.threads, "steps": args.steps,
                    "fraction": args.fraction, "native": native.status(),
                    "logical_mb": sum(r * d * 4 for r, d in specs.values()) / 1e6},
           "repeats": reps}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_put.json").write_text(json.dumps(doc, indent=1))
    md = markdown(doc)
    (args.out / "bench_put.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

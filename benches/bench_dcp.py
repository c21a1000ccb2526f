"""DCP through cnrstore vs DCP's own files: the same ``dcp.save`` / ``dcp.load`` of the
same DTensors, with ``cnrstore.dcp.StorageWriter``/``StorageReader`` or with
``FileSystemWriter``/``FileSystemReader`` (issue 25; runs in benches/results/bench_dcp.md).

    .venv/bin/python benches/bench_dcp.py --out /tmp/bench_dcp             # 4 ranks, 269 MB, 3 runs
    .venv/bin/python benches/bench_dcp.py --quick --out /tmp/bench_dcp_q   # CI smoke

The tables are benches/workload.py's (``--scale`` 0.25: 269 MB of fp32), rows sharded
over ``--world`` ranks as DTensor ``Shard(0)`` (benches/bench_dist.py's ``my_tables``);
every interval changes ``--fraction`` of each table's rows, the same in every system.
Systems, each one full save and ``--steps - 1`` later ones, every rank at once:

- ``fs``: ``dcp.save(sd, storage_writer=FileSystemWriter(dir/stepN))``.
- ``cnr``: ``dcp.save(sd, storage_writer=StorageWriter(path, step=N))``: the path is
  opened for each save (its diff bases seeded from the stored step).
- ``cnr_open``: ``StorageWriter(store, step=N)`` with one store opened for all saves
  (``cnrstore.open(path, group=WORLD)``): the diff bases stay in memory.

Bytes per step are allocated bytes on disk added by the step; save time is the slowest
rank's. Then ``--restore-world`` ranks (a world the step was not saved with) ``dcp.load``
the last step into zeroed DTensors of their own mesh after the page cache of the
checkpoint was evicted, and compare with the tables regenerated from the seed. Targets
(issue 25): a later save <= 0.1x the bytes of ``fs`` in <= 0.5x its time; the resharded
cold load <= 1.0x ``fs``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benches.bench_dist import _rows, chunk, my_tables, spawn, update  # noqa: E402

SYSTEMS = ("fs", "cnr", "cnr_open")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.25, help="table rows x (1: 1.075 GB)")
    p.add_argument("--world", type=int, default=4, help="ranks that save")
    p.add_argument("--restore-world", type=int, default=2, help="ranks that load")
    p.add_argument("--steps", type=int, default=3, help="saves: 1 full + later ones")
    p.add_argument("--fraction", type=float, default=0.01, help="rows changed per interval")
    p.add_argument("--dist", default="zipf", choices=["zipf", "uniform"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--out", default=None, help="folder for results.json and results.md")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of every system, interleaved; figures are their medians")
    p.add_argument("--quick", action="store_true", help="tiny run (CI smoke)")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.world, args.restore_world, args.steps = 0.002, 2, 1, 2
        args.repeat = 1
    return args


def _dtensors(args: argparse.Namespace, tables: dict, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = _rows(args)
    return {n: DTensor.from_local(t, mesh, [Shard(0)], run_check=False,
                                  shape=(rows[n], t.shape[1]), stride=(t.shape[1], 1))
            for n, t in tables.items()}


def save(rank: int, world: int, args: argparse.Namespace, root: str, system: str) -> list:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import cnrstore
    from benches.measure import disk_bytes
    from cnrstore.dcp import StorageWriter

    mine = my_tables(args, rank, world)
    sd = _dtensors(args, mine, world)  # views of ``mine``: updates show through
    path = os.path.join(root, "store")
    store = (cnrstore.open(path, group=dist.group.WORLD, timeout=args.timeout)
             if system == "cnr_open" else None)
    out = []
    before = disk_bytes(root) if rank == 0 else 0
    for step in range(args.steps):
        if step:
            update(args, mine, step, rank, world)
        dist.barrier()
        t0 = time.perf_counter()
        if system == "fs":
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(root, f"step{step}")))
        else:
            dcp.save(sd, storage_writer=StorageWriter(store if store is not None else path,
                                                      step=step))
        mine_s = time.perf_counter() - t0
        dist.barrier()
        all_s = time.perf_counter() - t0
        if rank == 0:
            now = disk_bytes(root)
            out.append({"step": step, "bytes": now - before, "save_s": mine_s,
                        "save_all_s": all_s})
            before = now
    if store is not None:
        store.close()
    return out


def load(rank: int, world: int, args: argparse.Namespace, root: str, system: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from benches.measure import evict_page_cache
    from cnrstore.dcp import StorageReader

    last = args.steps - 1
    rows = _rows(args)
    want = my_tables(args, rank, world)
    for step in range(1, args.steps):
        update(args, want, step, rank, world)
    zeros = {n: torch.zeros_like(t) for n, t in want.items()}
    sd = _dtensors(args, zeros, world)
    how = evict_page_cache(root) if rank == 0 else None
    dist.barrier()
    t0 = time.perf_counter()
    if system == "fs":
        dcp.load(sd, storage_reader=dcp.FileSystemReader(os.path.join(root, f"step{last}")))
    else:
        dcp.load(sd, storage_reader=StorageReader(os.path.join(root, "store"), step=last))
    mine_s = time.perf_counter() - t0
    dist.barrier()
    all_s = time.perf_counter() - t0
    assert all(chunk(rows[n], world, rank)[1] - chunk(rows[n], world, rank)[0]
               == zeros[n].shape[0] for n in rows)
    exact = all(torch.equal(sd[n].to_local(), want[n]) for n in rows)
    return {"load_s": mine_s, "load_all_s": all_s, "exact": exact, "evicted": how}


def run(args: argparse.Namespace) -> dict:
    from benches.workload import table_specs

    root = args.dir or tempfile.mkdtemp(prefix="bench-dcp-")
    logical = sum(r * d * 4 for r, d in table_specs(scale=args.scale).values())
    report: dict = {"args": dict(vars(args)), "logical_bytes": logical, "runs": []}
    systems = args.systems.split(",")
    for _ in range(args.repeat):  # the systems interleaved: the machine's load hits all
        runs: dict = {}
        for system in systems:
            where = os.path.join(root, system)
            shutil.rmtree(where, ignore_errors=True)
            os.makedirs(where)
            steps = spawn(args.world, "benches.bench_dcp:save", args, where, system,
                          timeout=args.timeout)[0]
            loads = spawn(args.restore_world, "benches.bench_dcp:load", args, where, system,
                          timeout=args.timeout)
            runs[system] = {
                "steps": steps, "load_s": max(r["load_all_s"] for r in loads),
                "exact": all(r["exact"] for r in loads), "evicted": loads[0]["evicted"]}
            print(system, json.dumps(runs[system]), flush=True)
            shutil.rmtree(where, ignore_errors=True)
        report["runs"].append({"systems": runs, "ratios": ratios({"systems": runs})})
    report["systems"] = {s: _median_run([r["systems"][s] for r in report["runs"]])
                         for s in systems}
    report["ratios"] = {name: {k: statistics.median(r["ratios"][name][k]
                                                    for r in report["runs"])
                               for k in q} for name, q in report["runs"][0]["ratios"].items()}
    return report


def _median_run(runs: list[dict]) -> dict:
    """Each figure of a system's runs, the median over the runs."""
    med = statistics.median
    return {"steps": [{k: med(r["steps"][i][k] for r in runs) for k in runs[0]["steps"][i]}
                      for i in range(len(runs[0]["steps"]))],
            "load_s": med(r["load_s"] for r in runs), "exact": all(r["exact"] for r in runs),
            "evicted": runs[0]["evicted"]}


def _later(r: dict, key: str) -> float:
    later = r["steps"][1:] or r["steps"]
    return sum(s[key] for s in later) / len(later)


def ratios(report: dict) -> dict[str, dict[str, float]]:
    """Each cnrstore system against ``fs``: later-save bytes and time, cold load time."""
    fs = report["systems"].get("fs")
    if fs is None:
        return {}
    out = {}
    for name, r in report["systems"].items():
        if name != "fs":
            out[name] = {"later_bytes": _later(r, "bytes") / max(1, _later(fs, "bytes")),
                         "later_time": _later(r, "save_all_s") / _later(fs, "save_all_s"),
                         "load_time": r["load_s"] / fs["load_s"]}
    return out


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [
        f"{a['world']} ranks save, {a['restore_world']} load; "
        f"{report['logical_bytes'] / 1e6:.1f} MB of fp32 tables as DTensor Shard(0); "
        f"{a['steps']} saves (1 full + {a['steps'] - 1} later), {a['fraction'] * 100:g}% "
        f"{a['dist']} rows per interval; medians of {a['repeat']} runs (ratios: the "
        "median of each run's ratio).", "",
        "| system | full MB | later MB/save | full save s | later save s | cold load s "
        "(other world) | exact | later bytes / fs | later time / fs | load / fs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rat = report.get("ratios", {})
    for name, r in report["systems"].items():
        st = r["steps"][0]
        q = rat.get(name)
        tail = (f"{q['later_bytes']:.3f} | {q['later_time']:.2f} | {q['load_time']:.2f}"
                if q else "1 | 1 | 1")
        lines.append(
            f"| {name} | {st['bytes'] / 1e6:.1f} | {_later(r, 'bytes') / 1e6:.2f} | "
            f"{st['save_all_s']:.2f} | {_later(r, 'save_all_s'):.2f} | {r['load_s']:.2f} | "
            f"{'yes' if r['exact'] else 'NO'} | {tail} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = markdown(report)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

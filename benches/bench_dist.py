"""Many ranks: the same sharded tables through cnrstore's distributed store and through
torch.distributed.checkpoint (DCP), in one run (issue 11; runs in benches/results/bench_dist.md).

    .venv/bin/python benches/bench_dist.py --out /tmp/bench_dist            # 4 ranks, 1.075 GB
    .venv/bin/python benches/bench_dist.py --quick --out /tmp/bench_dist_q  # CI smoke, seconds

The tables are benches/workload.py's (five fp32 tables of 64-dim rows, 1.075 GB at
``--scale 1``), split row-wise over ``--world`` ranks exactly as a DTensor ``Shard(0)``
splits them (``torch.chunk``), so both systems hold identical local rows. Every interval
changes ``--fraction`` of each table's rows (Zipf over scattered ids), the same rows and
values in every system. Per system, one full checkpoint and ``--steps - 1`` incremental
ones, every rank at once (gloo, one thread per rank, all on this machine):

- ``cnr``: ``store.put_tables(step, {name: cnrstore.Shard(...)}, blocking=False)``; the
  stall is the time to the Future, the put time the time to its result. ``cnr_int8``:
  the same with ``quant="int8"`` (not in the default ``--systems``).
- ``cnr_shared``: the same on a shared-directory store (packs in the checkpoint folder,
  rank 0's index in a cache folder beside it: ``cnrstore.open(path, cache_dir=...)``),
  what several hosts would use on NFS/Lustre. ``cnr_s3``: the same on S3
  (``cnrstore.open("s3://...", cache_dir=..., group=...)``), against ``--endpoint`` or a
  SeaweedFS started here on loopback; its bytes are the store's ``stats()`` (packs in the
  bucket). Neither is in the default ``--systems``.
- ``dcp``: ``dcp.save`` of DTensors (``Shard(0)``), one checkpoint directory per step.
- ``dcp_async``: ``dcp.async_save`` of the same; stall to the Future, put to its result.

Bytes per step are allocated bytes on disk added by the step. Then ``--restore-world``
ranks restore the last step, each its own ``torch.chunk`` share of every table (a world
size the checkpoint was not written with): cnrstore with ``get_tables(rows=...)``, DCP
with ``dcp.load`` into DTensors of the new mesh, after evicting the page cache of both
checkpoints; both results are compared with the tables regenerated from the seed.
dcp.load fills tensors that exist before its clock starts, so cnrstore is timed that way
too, from a cold cache again: ``get_tables(out={name: cnrstore.Shard(zeros, ...)})``
("into existing tensors"); the fresh-tensor restore also allocates and faults its output.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="table rows x (1: 1.075 GB)")
    p.add_argument("--world", type=int, default=4, help="ranks that save")
    p.add_argument("--restore-world", type=int, default=2, help="ranks that restore")
    p.add_argument("--steps", type=int, default=3, help="checkpoints: 1 full + incremental")
    p.add_argument("--fraction", type=float, default=0.05, help="rows changed per interval")
    p.add_argument("--dist", default="zipf", choices=["zipf", "uniform"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="cnr,dcp,dcp_async")
    p.add_argument("--block-rows", type=int, default=None,
                   help="block_rows of the cnrstore stores (default: a new store's)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--out", default=None, help="folder for results.json and results.md")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--endpoint", default=None,
                   help="S3 endpoint for cnr_s3 (default: start SeaweedFS on loopback)")
    p.add_argument("--bucket", default="cnr-bench")
    p.add_argument("--quick", action="store_true", help="tiny run (CI smoke)")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.world, args.restore_world, args.steps = 0.002, 2, 1, 2
    return args


# -- the tables each rank holds ------------------------------------------------------------

def chunk(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows of ``rank`` as DTensor Shard(0) (torch.chunk) places them."""
    per = -(-rows // world)
    lo = min(rows, rank * per)
    return lo, min(rows, lo + per)


def my_tables(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    """This rank's rows of every table after the last update (regenerated from the seed,
    one whole table at a time, as benches/workload.make_tables makes them)."""
    import numpy as np
    import torch

    from benches.workload import _generator, table_specs

    out = {}
    for i, (name, (rows, dim)) in enumerate(table_specs(scale=args.scale).items()):
        bound = 1.0 / float(np.sqrt(rows))
        t = torch.empty(rows, dim, dtype=torch.float32)
        t.uniform_(-bound, bound, generator=_generator(args.seed, 1, i))
        lo, hi = chunk(rows, world, rank)
        out[name] = t[lo:hi].clone()
        del t
    return out


def update(args: argparse.Namespace, mine: dict, step: int, rank: int, world: int) -> None:
    """Interval ``step``'s update (benches/workload.apply_update) on this rank's rows."""
    import torch

    from benches.workload import UPDATE_STD, Workload, _generator, changed_rows

    w = Workload(args.fraction, args.dist)
    for i, (name, t) in enumerate(mine.items()):
        rows = _rows(args)[name]
        ids = changed_rows(rows, w, seed=args.seed, step=step, table_index=i)
        delta = torch.randn(len(ids), t.shape[1], dtype=t.dtype,
                            generator=_generator(args.seed, 4, step, i)).mul_(UPDATE_STD)
        lo, hi = chunk(rows, world, rank)
        sel = (ids >= lo) & (ids < hi)
        t.index_add_(0, torch.from_numpy(ids[sel] - lo), delta[torch.from_numpy(sel)])


def _rows(args: argparse.Namespace) -> dict[str, int]:
    from benches.workload import table_specs

    return {n: r for n, (r, _) in table_specs(scale=args.scale).items()}


# -- rank programs ---------------------------------------------------------------------------

def _init(rank: int, world: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def _save(rank: int, world: int, args: argparse.Namespace, root: str, system: str) -> list:
    import torch.distributed as dist

    from benches.measure import disk_bytes

    mine = my_tables(args, rank, world)
    rows = _rows(args)
    out = []
    cnr = system.startswith("cnr")
    if cnr:
        import cnrstore

        store = _open_cnr(args, root, system, rank)
        quant = "int8" if system == "cnr_int8" else "exact"
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
    def stored() -> int:  # collective for cnr_s3 (stats is), rank 0's figure otherwise
        if system == "cnr_s3":
            return store.stats().stored_bytes
        return disk_bytes(root) if rank == 0 else 0

    before = stored()
    for step in range(args.steps):
        if step:
            update(args, mine, step, rank, world)
        dist.barrier()
        t0 = time.perf_counter()
        if cnr:
            tables = {n: cnrstore.Shard(t, row_offset=chunk(rows[n], world, rank)[0],
                                        rows=rows[n]) for n, t in mine.items()}
            fut = store.put_tables(step, tables, quant=quant, blocking=False)
            stall = time.perf_counter() - t0
            fut.result()
        else:
            sd = {n: DTensor.from_local(t, mesh, [Shard(0)], run_check=False,
                                        shape=(rows[n], t.shape[1]), stride=(t.shape[1], 1))
                  for n, t in mine.items()}
            where = os.path.join(root, system, f"step{step}")
            if system == "dcp":
                dcp.save(sd, checkpoint_id=where)
                stall = time.perf_counter() - t0
            else:
                f = dcp.async_save(sd, checkpoint_id=where)
                stall = time.perf_counter() - t0
                f.result()
        put = time.perf_counter() - t0
        dist.barrier()
        put_all = time.perf_counter() - t0
        now = stored()
        if rank == 0:
            out.append({"step": step, "bytes": now - before, "put_s": put,
                        "put_all_s": put_all, "stall_s": stall})
            before = now
    if cnr:
        store.close()
    return out


def _open_cnr(args: argparse.Namespace, root: str, system: str, rank: int) -> Any:
    """The system's store, collectively: a directory, a shared directory with rank 0's
    cache beside it, or a bucket prefix with that cache (other ranks never make one)."""
    import torch.distributed as dist

    import cnrstore

    kw: dict = {"group": dist.group.WORLD, "timeout": args.timeout}
    if getattr(args, "block_rows", None):
        kw["block_rows"] = args.block_rows
    if system == "cnr_shared":
        kw["cache_dir"] = os.path.join(os.path.dirname(root), f"cache-{system}-{rank}")
    if system == "cnr_s3":
        kw["cache_dir"] = os.path.join(os.path.dirname(root), f"cache-{system}-{rank}")
        kw["storage_options"] = args.s3_options
        return cnrstore.open(args.s3_url, **kw)
    return cnrstore.open(os.path.join(root, "cnr"), **kw)


def _restore(rank: int, world: int, args: argparse.Namespace, root: str, system: str,
             save_world: int) -> dict:
    import torch
    import torch.distributed as dist

    from benches.measure import evict_page_cache
    from benches.workload import table_specs

    rows = _rows(args)
    last = args.steps - 1
    if rank == 0:
        evict_page_cache(root)
    cnr = system.startswith("cnr")
    if cnr:

        store = _open_cnr(args, root, system, rank)
        sel = {n: slice(*chunk(r, world, rank)) for n, r in rows.items()}
        dist.barrier()
        t0 = time.perf_counter()
        got = store.get_tables(last, names=list(rows), rows=sel)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        dims = {n: d for n, (_, d) in table_specs(scale=args.scale).items()}
        sd = {}
        for n, r in rows.items():
            lo, hi = chunk(r, world, rank)
            sd[n] = DTensor.from_local(torch.zeros(hi - lo, dims[n]), mesh, [Shard(0)],
                                       run_check=False, shape=(r, dims[n]),
                                       stride=(dims[n], 1))
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=os.path.join(root, system, f"step{last}"))
        got = {n: t.to_local() for n, t in sd.items()}
    seconds = time.perf_counter() - t0
    dist.barrier()
    seconds_all = time.perf_counter() - t0
    want = my_tables(args, rank, world)
    for step in range(1, args.steps):
        update(args, want, step, rank, world)
    exact = all(torch.equal(got[n], want[n]) for n in rows)
    err = max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30))
              for n in rows)
    inplace = seconds  # dcp.load always fills the tensors it is given
    if cnr:
        # Like for like with dcp.load: into zeroed tensors made before the clock starts,
        # from a cold cache again (get_tables(out=...) with Shards: docs/GUIDE.md, "Many ranks
        # and object stores").
        import cnrstore

        del got
        if rank == 0:
            evict_page_cache(root)
        out = {}
        for n, r in rows.items():
            lo, hi = chunk(r, world, rank)
            out[n] = cnrstore.Shard(torch.zeros(hi - lo, want[n].shape[1]), lo, r)
        dist.barrier()
        t0 = time.perf_counter()
        store.get_tables(last, out=out)
        inplace = time.perf_counter() - t0
        dist.barrier()
        exact = exact and all(torch.equal(out[n].local, want[n]) for n in rows)
        store.close()
    return {"restore_s": seconds, "restore_all_s": seconds_all, "exact": exact,
            "rel_error": err, "restore_inplace_s": inplace}


def _rank_main(rank: int, world: int, port: int, out: str, fn: str, fargs: tuple) -> None:
    _init(rank, world, port)
    try:
        if ":" in fn:  # another bench's rank program ("module:function"), same plumbing
            import importlib

            module, _, name = fn.partition(":")
            program = getattr(importlib.import_module(module), name)
        else:
            program = globals()[fn]
        result: Any = program(rank, world, *fargs)
    except BaseException as exc:  # reported by the parent
        import traceback

        result = RuntimeError(f"rank {rank}: {exc}\n{traceback.format_exc()}")
    with open(out, "wb") as f:
        pickle.dump(result, f)
    os._exit(0)


def spawn(world: int, fn: str, *fargs: Any, timeout: float) -> list:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="bench-dist-")
    outs = [os.path.join(tmp, f"{r}.pkl") for r in range(world)]
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, outs[r], fn, fargs))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            raise SystemExit(f"{fn}: ranks still ran after {timeout} s")
    results = []
    for rank, path in enumerate(outs):
        if not os.path.exists(path):  # died before its result: a signal, or os._exit
            raise RuntimeError(f"{fn}: rank {rank} left no result "
                               f"(exit codes {[p.exitcode for p in procs]})")
        with open(path, "rb") as f:
            r = pickle.load(f)
        if isinstance(r, BaseException):
            raise r
        results.append(r)
    shutil.rmtree(tmp, ignore_errors=True)
    return results


# -- the run ---------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    from benches.workload import table_specs

    root = args.dir or tempfile.mkdtemp(prefix="bench-dist-ckpt-")
    logical = sum(r * d * 4 for r, d in table_specs(scale=args.scale).values())
    report: dict = {"args": dict(vars(args)), "logical_bytes": logical, "systems": {}}
    weed = None
    if "cnr_s3" in args.systems.split(","):
        weed = _s3_setup(args, root)
    try:
        _run_systems(args, root, report)
    finally:
        if weed is not None:
            weed.stop()
    return report


def _s3_setup(args: argparse.Namespace, root: str) -> Any:
    """Endpoint and options for cnr_s3 (a SeaweedFS on loopback unless --endpoint)."""
    weed = None
    endpoint = args.endpoint
    if endpoint is None:
        sys.path.insert(0, os.path.join(REPO, "tests", "engine"))
        from _weed import Weed

        os.makedirs(os.path.join(root, "weed"), exist_ok=True)
        weed = Weed(os.path.join(root, "weed"))
        weed.bucket = args.bucket
        weed.start()
        endpoint = weed.endpoint
    args.s3_url = f"s3://{args.bucket}/bench-dist-{os.getpid()}"
    args.s3_options = {"endpoint": endpoint,
                       "access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", "x"),
                       "secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", "x"),
                       "region": os.environ.get("AWS_REGION", "us-east-1")}
    return weed


def _run_systems(args: argparse.Namespace, root: str, report: dict) -> None:
    for system in args.systems.split(","):
        where = os.path.join(root, system)
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
        steps = spawn(args.world, "_save", args, where, system, timeout=args.timeout)[0]
        rest = spawn(args.restore_world, "_restore", args, where, system, args.world,
                     timeout=args.timeout)
        report["systems"][system] = {
            "steps": steps,
            "restore_s": max(r["restore_s"] for r in rest),
            "restore_inplace_s": max(r["restore_inplace_s"] for r in rest),
            "restore_exact": all(r["exact"] for r in rest),
            "restore_rel_error": max(r["rel_error"] for r in rest),
        }
        print(system, json.dumps(report["systems"][system]), flush=True)
        shutil.rmtree(where, ignore_errors=True)


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [
        f"{a['world']} ranks save, {a['restore_world']} restore; "
        f"{report['logical_bytes'] / 1e6:.1f} MB of fp32 tables; {a['steps']} steps "
        f"(1 full + {a['steps'] - 1} incremental), {a['fraction'] * 100:g}% {a['dist']} "
        "rows per interval.",
        "",
        "| system | full MB | incr MB/step | full put s | incr put s | incr stall s | "
        "restore s (other world) | into existing tensors s | exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["systems"].items():
        st = r["steps"]
        inc = st[1:] or st

        def mean(k: str, inc: list = inc) -> float:
            return sum(s[k] for s in inc) / len(inc)

        err = r.get("restore_rel_error", 0.0)
        exact = "yes" if r["restore_exact"] else f"no (rel. L2 error {err:.1e})"
        lines.append(
            f"| {name} | {st[0]['bytes'] / 1e6:.1f} | {mean('bytes') / 1e6:.1f} | "
            f"{st[0]['put_all_s']:.2f} | {mean('put_all_s'):.2f} | {mean('stall_s'):.2f} | "
            f"{r['restore_s']:.2f} | {r['restore_inplace_s']:.2f} | {exact} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = markdown(report)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

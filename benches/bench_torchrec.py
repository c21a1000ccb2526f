"""TorchRec's DLRM through cnrstore and through torch.distributed.checkpoint (DCP), same run
(issue 12; figures in docs/TORCHREC.md).

    .venv/bin/python benches/bench_torchrec.py --out /tmp/bench_tr          # 4 ranks
    .venv/bin/python benches/bench_torchrec.py --quick --out /tmp/bench_trq # smoke, ~1 min
    # one part alone, on checkpoints kept from an earlier run's save part:
    .venv/bin/python benches/bench_torchrec.py --parts save --root /tmp/trk --out /tmp/tr
    .venv/bin/python benches/bench_torchrec.py --parts restore --root /tmp/trk --out /tmp/tr \
        --profile /tmp/trp        # + per-rank cProfile, CPU time and page faults
    .venv/bin/python benches/bench_torchrec.py --parts overhead --every 100 --out /tmp/tr

A DistributedModelParallel DLRMTrain (cnrstore/demo/torchrec_demo.py: tables row-wise,
table-wise and table-row-wise, row-wise Adagrad fused into backward) trains at ``--world``
ranks on TorchRec's random click dataset. Every ``--train`` steps it checkpoints
``{"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}``; one run per
system, same seed, so every system saves the same states:

- ``cnr``: ``store.put_state(step, state, blocking=False)``: stall to the Future, put to
  its result; ``cnr_tracker``: the same with ``touched=`` TorchRec's ModelDeltaTracker.
- ``dcp``: ``dcp.save(state)``, one directory per checkpoint.
- ``dcp_async``: ``dcp.async_save(state)``: stall to the Future, put to its result; the
  DMP in DTensor output mode (async_save's staging calls data_ptr(), which a
  ShardedTensor refuses).

Bytes per checkpoint are bytes allocated on disk that the checkpoint added. Then
``--restore-world`` ranks build the DMP under another plan and restore the last checkpoint
(cnrstore: cnrstore.distributed.torchrec.load; DCP: dcp.load into the new DMP's state), after
evicting the page cache; the restored local rows of both are compared.
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
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

SYSTEMS = ("cnr", "cnr_tracker", "dcp", "dcp_async")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=250_000, help="rows of each of 4 tables")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--restore-world", type=int, default=2)
    p.add_argument("--checkpoints", type=int, default=4, help="1 full + incremental")
    p.add_argument("--train", type=int, default=10, help="training steps between them")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--quick", action="store_true", help="small tables, 2 ranks")
    p.add_argument("--parts", default="save,restore,overhead",
                   help="comma-separated subset: save, restore (of a saved run), overhead")
    p.add_argument("--root", default=None, help="keep the checkpoints here (a restore "
                   "part alone reads those of an earlier save part with the same sizes)")
    p.add_argument("--overhead-systems", default="none,cnr,dcp_async,tracker,cnr_fp",
                   help="comma-separated subset of the overhead runs ('none' is needed)")
    p.add_argument("--profile", default=None, help="directory: each rank's cProfile of "
                   "its later puts' stall / "
                   "its timed restore / training loop (.prof and a .txt of the top)")
    p.add_argument("--out", required=True)
    p.add_argument("--overhead-steps", default="200,600",
                   help="training steps of each overhead run: one count, or one per "
                   "--every entry (0: no overhead runs)")
    p.add_argument("--every", default="10,100", help="checkpoint intervals, overhead runs")
    p.add_argument("--repeat", type=int, default=3, help="overhead runs per system and "
                   "interval (median), and restores per system")
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    if "restore" in parts and "save" not in parts and a.root is None:
        # Without it the restore part found nothing to read and printed an empty table.
        p.error("--parts restore without save reads an earlier run's checkpoints: give --root")
    if a.quick:
        a.rows, a.dim, a.world, a.restore_world, a.checkpoints, a.train = 20_000, 16, 2, 3, 3, 3
        a.overhead_steps, a.every, a.repeat = 20, "10", 1
    return a


def _hash(a) -> list[int]:
    return [a.rows, a.rows // 2, a.rows // 4, a.rows // 8]


def _dmp(a, world: int, rank: int, tracker: bool = False, dtensor: bool = False):
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from cnrstore.demo import torchrec_demo as d

    torch.manual_seed(0)
    net = d.model(world, _hash(a), a.dim)
    apply_optimizer_in_backward(RowWiseAdagrad, net.model.sparse_arch.parameters(),
                                {"lr": 0.05})
    env = ShardingEnv(world, rank, dist.group.WORLD, output_dtensor=dtensor)
    dmp = DistributedModelParallel(net, env=env,
                                   device=torch.device("cpu"), plan=d.plan(net, world))
    trk = None
    if tracker:
        from torchrec.distributed.model_tracker.types import DeltaTrackerConfig

        trk = dmp.init_torchrec_delta_tracker(DeltaTrackerConfig())
    return dmp, trk


def _state(dmp) -> dict:
    return {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}


def _save(rank: int, world: int, a, root: str, system: str) -> list:
    import torch.distributed as dist

    import cnrstore
    from cnrstore.demo import torchrec_demo as d
    from cnrstore.tools.info import disk_bytes

    # dcp.async_save stages with data_ptr(), which ShardedTensor refuses: DTensor mode
    dmp, trk = _dmp(a, world, rank, tracker=system == "cnr_tracker",
                    dtensor=system == "dcp_async")
    where = os.path.join(root, system)
    data = d.batches(0, 0, _hash(a))
    store = cnrstore.open(where, group=dist.group.WORLD) if system.startswith("cnr") else None
    out = []
    # the later puts' stall only (the caller's thread up to the Future), summed over them
    prof = None
    if a.profile and store is not None and a.checkpoints > 1:
        import cProfile

        prof = cProfile.Profile()
    for k in range(a.checkpoints):
        for _ in range(a.train if k else 1):
            loss, _ = dmp(d.local_part(next(data), rank, world))
            loss.backward()
        before = disk_bytes(where) if rank == 0 else 0
        dist.barrier()
        t0 = time.perf_counter()
        if store is not None:
            if prof is not None and k:
                prof.enable()
            fut = store.put_state(k, _state(dmp), blocking=False, touched=trk)
            stall = time.perf_counter() - t0
            if prof is not None and k:
                prof.disable()
            fut.result()
        else:
            import torch.distributed.checkpoint as dcp

            cid = os.path.join(where, f"step{k}")
            if system == "dcp":
                dcp.save(_state(dmp), checkpoint_id=cid)
                stall = time.perf_counter() - t0
            else:
                f = dcp.async_save(_state(dmp), checkpoint_id=cid)
                stall = time.perf_counter() - t0
                f.result()
        put = time.perf_counter() - t0
        dist.barrier()
        if rank == 0:
            out.append({"step": k, "stall_s": stall, "put_s": put,
                        "bytes": disk_bytes(where) - before})
    if store is not None:
        store.close()
    if prof is not None:
        import pstats

        os.makedirs(a.profile, exist_ok=True)
        path = os.path.join(a.profile, f"stall_{system}_{rank}")
        prof.dump_stats(path + ".prof")
        with open(path + ".txt", "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)
    return out


def _restores(rank: int, world: int, a, root: str, systems: list[str]) -> dict:
    """``a.repeat`` cold restores of each system, interleaved (their order alternates), in
    one set of ranks: each into a new DMP, after the page cache of the system's files is
    evicted. A set of ranks per restore spent most of a bench lock's hold starting
    processes (0.5 s restores, ~40 s starts on a loaded 2-core machine)."""
    import gc

    out: dict[str, list] = {s: [] for s in systems}
    for i in range(a.repeat):
        for system in systems if i % 2 == 0 else systems[::-1]:
            out[system].append(_restore(rank, world, a, root, system,
                                        last_repeat=i == a.repeat - 1))
            gc.collect()
    return out


def _restore(rank: int, world: int, a, root: str, system: str, last_repeat: bool) -> dict:
    import torch
    import torch.distributed as dist

    from benches.measure import Measured, evict_page_cache
    from cnrstore.distributed.leaves import shard_leaf
    from cnrstore.distributed.torchrec import _leaf_paths

    dmp, _ = _dmp(a, world, rank)
    last = a.checkpoints - 1
    if rank == 0:
        evict_page_cache(os.path.join(root, system))
    dist.barrier()
    t0 = time.perf_counter()
    with Measured(a.profile, f"restore_{system}", rank) as m:
        if system == "cnr":
            import cnrstore
            from cnrstore.distributed import torchrec as ctr

            store = cnrstore.open(os.path.join(root, system), group=dist.group.WORLD)
            ctr.load(store, last, dmp)
            store.close()
        else:
            import torch.distributed.checkpoint as dcp

            dcp.load(_state(dmp), checkpoint_id=os.path.join(root, system, f"step{last}"))
    seconds = time.perf_counter() - t0
    dist.barrier()
    every_rank = time.perf_counter() - t0  # the job waits for its slowest rank
    if last_repeat:
        rows = {}
        for path, leaf in _leaf_paths(_state(dmp)):
            for s in shard_leaf(leaf) or []:
                rows[(path, s.row_offset)] = s.local.clone()
        torch.save(rows, os.path.join(root, f"restored_{system}_{rank}.pt"))
    return {"restore_s": seconds, "restore_all_s": every_rank, **m.got}


def _steps(a) -> dict[int, int]:
    """Training steps of an overhead run per checkpoint interval: ``--overhead-steps``
    is one count for every interval, or one per ``--every`` entry."""
    every = [int(x) for x in a.every.split(",")]
    steps = [int(x) for x in str(a.overhead_steps).split(",")]
    if len(steps) == 1:
        steps = steps * len(every)
    if len(steps) != len(every):
        raise SystemExit(f"--overhead-steps {a.overhead_steps}: one count, or one per "
                         f"--every entry ({a.every})")
    return dict(zip(every, steps))


def _task_cpu(tids: set[int] | None = None) -> dict[int, float]:
    """CPU seconds of this process's threads by kernel id (all, or ``tids``), from
    schedstat's nanoseconds (rusage per thread and /proc's stat count 10 ms ticks)."""
    out = {}
    for tid in tids if tids is not None else map(int, os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            pass  # ended
    return out


def _training_threads() -> set[int]:
    """The threads training uses besides the main one: gloo's workers of the groups made
    so far (the DMP's), which run its collectives. Called before a system opens its
    store or group, every later thread is the checkpoint's: a store's gloo groups, the
    writer and its pools, async_save's thread (one a save, ended when it is done), and
    any Python thread a previous run left."""
    import threading

    python = {t.native_id for t in threading.enumerate()}
    return set(_task_cpu()) - python - {threading.main_thread().native_id}


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live Python thread but the main one, summed by name (the part
    before a pool's worker number): where a checkpoint's background CPU goes."""
    import threading

    cpu = _task_cpu({t.native_id for t in threading.enumerate()
                     if t is not threading.main_thread() and t.native_id is not None})
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.native_id in cpu:
            name = t.name.rsplit("_", 1)[0] if t.name[-1:].isdigit() else t.name
            out[name] = out.get(name, 0.0) + cpu[t.native_id]
    return out


def _timed_gc() -> tuple[list[float], Any]:
    """Seconds and collections of Python's cyclic GC on the main thread, from now on
    (``gc.callbacks``): a put's objects move the collector's thresholds, and a full
    collection walks every object of the process, TorchRec's model among them. Returns
    ([seconds, collections, of them full], the callback to remove)."""
    import gc
    import threading

    got = [0.0, 0, 0]
    start = [0.0]
    main = threading.main_thread().ident

    def cb(phase: str, info: dict) -> None:
        if threading.get_ident() != main:
            return
        if phase == "start":
            start[0] = time.perf_counter()
        else:
            got[0] += time.perf_counter() - start[0]
            got[1] += 1
            got[2] += info.get("generation") == 2
    gc.callbacks.append(cb)
    return got, cb


def _timed_hook(trk) -> list[float]:
    """Time TorchRec's tracker hook on this rank: the post-lookup function it registered
    calls ``record_ids`` (ID_ONLY, the default mode) by attribute, so the instance's
    ``record_ids`` is wrapped; the list gathers its main-thread CPU seconds."""
    spent = [0.0]
    inner = trk.record_ids

    def record_ids(kjt):
        t = time.thread_time()
        inner(kjt)
        spent[0] += time.thread_time() - t

    trk.record_ids = record_ids
    return spent


def _train(rank: int, world: int, a, root: str, system: str, every: int, steps: int,
           run: int = 0) -> dict:
    """``steps`` training steps with a checkpoint every ``every`` (none for ``none``)
    after one untimed checkpoint, timed from the first step to the last checkpoint
    durable: ``cnr`` puts non-blocking with TorchRec's tracker as ``touched=``,
    ``dcp_async`` is dcp.async_save, each waiting for its previous save only when the
    next one starts (DCP allows one in flight; cnrstore queues up to max_inflight). Two
    runs split cnrstore's figure: ``tracker`` trains with the tracker on and only reads it
    at each checkpoint (its cost is TorchRec's lookup hook), ``cnr_fp`` puts without a
    tracker (fingerprints find the changed rows).

    Besides the wall time, what the checkpoints cost the rank directly, in the same run:
    the caller's stall (wall and main-thread CPU, per checkpoint), the CPU of every
    thread but training's (``_training_threads``: the writer's, async_save's, their
    groups') and of the tracker's hook."""
    import torch.distributed as dist

    import cnrstore
    from benches.measure import Measured
    from cnrstore.demo import torchrec_demo as d

    dmp, trk = _dmp(a, world, rank, tracker=system in ("cnr", "tracker"),
                    dtensor=system == "dcp_async")
    hook = _timed_hook(trk) if trk is not None else [0.0]
    training = _training_threads()
    where = os.path.join(root, f"{system}_{every}_{run}")
    data = d.batches(0, 0, _hash(a))
    batches = [d.local_part(next(data), rank, world) for _ in range(steps)]
    store = cnrstore.open(where, group=dist.group.WORLD) if system.startswith("cnr") else None
    # async_save's collectives run on a thread beside training's: a group of their own
    ckpt_pg = dist.new_group(backend="gloo") if system == "dcp_async" else None
    loss, _ = dmp(batches[0])  # the first step builds what TorchRec builds lazily
    loss.backward()
    # A job in its steady state has checkpointed before: one untimed checkpoint first
    # (cnrstore's is the full one, whose blocks the timed ones diff against).
    if store is not None:  # reading the tracker there: the warm-up's lookups are not timed
        store.put_state(0, _state(dmp), touched=trk)
    elif trk is not None:
        trk.get_unique_ids()
    elif system == "dcp_async":
        import torch.distributed.checkpoint as dcp

        dcp.async_save(_state(dmp), process_group=ckpt_pg,
                       checkpoint_id=os.path.join(where, "step0")).result()
    hook[0] = 0.0
    dist.barrier()
    threads0, training0 = _thread_cpu(), _task_cpu(training)
    gcs, gc_cb = _timed_gc()
    t0 = time.perf_counter()
    pending = None
    stalls, stall_cpu = [], []
    with Measured(a.profile, f"train_{system}_{every}", rank) as m:
        for k, batch in enumerate(batches[1:], start=1):
            loss, _ = dmp(batch)
            loss.backward()
            if system != "none" and k % every == 0:
                t1, c1 = time.perf_counter(), time.thread_time()
                if store is not None:
                    pending = store.put_state(k, _state(dmp), blocking=False, touched=trk)
                elif trk is not None:
                    trk.get_unique_ids()
                else:
                    import torch.distributed.checkpoint as dcp

                    if pending is not None:
                        pending.result()
                    pending = dcp.async_save(_state(dmp), process_group=ckpt_pg,
                                             checkpoint_id=os.path.join(where, f"step{k}"))
                stalls.append(time.perf_counter() - t1)
                stall_cpu.append(time.thread_time() - c1)
        t1 = time.perf_counter()
        if pending is not None:
            pending.result()
        tail = time.perf_counter() - t1
    seconds = time.perf_counter() - t0
    import gc

    gc.callbacks.remove(gc_cb)
    threads = {k: v - threads0.get(k, 0.0) for k, v in _thread_cpu().items()}
    training1 = _task_cpu(training)
    gloo = sum(v - training0.get(k, v) for k, v in training1.items())
    dist.barrier()
    if store is not None:
        store.close()
    if ckpt_pg is not None:
        dist.destroy_process_group(ckpt_pg)
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    return {"seconds": seconds, "saves": len(stalls), "stall_s": sum(stalls),
            "stalls": stalls, "stall_cpu_s": sum(stall_cpu), "tail_s": tail,
            "hook_cpu_s": hook[0], "thread_cpu": threads, "training_bg_cpu_s": gloo,
            "gc_s": gcs[0], "gc_runs": gcs[1], "gc_full": gcs[2],
            **m.got, "ckpt_bg_cpu_s": m.got["bg_cpu_s"] - gloo}


def _order(systems: list[str], repeat: int) -> list[tuple[int, str]]:
    """Each repeat runs every system once, the order rotated by one a repeat: every
    system takes every place in the rotation alike (after a given system, first after
    the warm-up), and a drift of the machine's load meets them all."""
    n = len(systems)
    return [(i, systems[(i + j) % n]) for i in range(repeat) for j in range(n)]


def _trains(rank: int, world: int, a, root: str, every: int, steps: int,
            systems: list[str]) -> list[dict]:
    """Every overhead run of one interval in one set of ranks, each into a new DMP (one
    set of ranks a run spent ~30 s of a 45 s run starting processes and building the
    first DMP). An untimed warm-up run first takes what a process's first training pays
    (allocator growth, lazy imports) away from whichever system would run first."""
    import gc

    import torch.distributed as dist

    _train(rank, world, a, root, "none", every, min(steps, 20), run=-1)
    out = []
    for i, system in _order(systems, a.repeat):
        gc.collect()
        got = _train(rank, world, a, root, system, every, steps, run=i)
        ranks: list = [None] * world
        dist.all_gather_object(ranks, got)
        if rank == 0:  # each run as it ends: a hold of the bench lock cut short keeps them
            print("overhead run", every, system, json.dumps(ranks), flush=True)
        out.append({"system": system, "repeat": i, "ranks": ranks})
    return out


def _direct(r: list, none_s: float, busy: float) -> tuple[float, float]:
    """Overhead estimated from one run's own measures, as (lower, upper) bounds. Lower:
    the slowest rank's stall at each checkpoint over the no-checkpoint run's wall time
    (no rank trains while the put holds them all in its rounds). Upper: that plus the CPU
    the checkpoints took on every rank outside the stall (the threads that are not
    training's, the tracker's hook) at the no-checkpoint run's parallelism ``busy`` (CPU
    seconds per wall second): what it costs where the ranks have the machine to
    themselves and every CPU second is one training does not get. On a machine shared
    with other work a background thread also takes its share from that work, and the
    wall time lies between the two. The stall's CPU is inside its wall time, so it is
    not counted twice."""
    stall = sum(max(x["stalls"][i] for x in r) for i in range(len(r[0]["stalls"])))
    cpu = sum(x["ckpt_bg_cpu_s"] + x["hook_cpu_s"] for x in r)
    return stall / none_s, (stall + cpu / busy) / none_s


def overhead(a, root: str) -> dict:
    """Training overhead per interval: each system's wall time over the no-checkpoint
    run's (medians of ``a.repeat`` runs, their spread, all runs in one set of ranks in
    rotation), the CPU seconds of all ranks over those of the no-checkpoint run, and the
    overhead estimated from each run's own measures (``_direct``)."""
    out: dict = {}
    systems = a.overhead_systems.split(",")
    for every, steps in _steps(a).items():
        got = spawn(a.world, "_trains", a, root, every, steps, systems)[0]
        runs: dict[str, list[float]] = {s: [] for s in systems}
        cpu: dict[str, list[float]] = {s: [] for s in systems}
        ranks: dict[str, list] = {s: [] for s in systems}
        for g in got:
            runs[g["system"]].append(max(x["seconds"] for x in g["ranks"]))
            cpu[g["system"]].append(sum(x["cpu_s"] for x in g["ranks"]))
            ranks[g["system"]].append(g["ranks"])
        med = {s: statistics.median(v) for s, v in runs.items()}
        cmed = {s: statistics.median(v) for s, v in cpu.items()}
        base = med.get("none")
        res: dict = {"steps": steps, "runs": runs, "cpu_s": cpu, "median_s": med,
                     "ranks": ranks}
        if base:
            busy = cmed["none"] / base
            res["busy_cores"] = busy
            res["overhead"] = {s: med[s] / base - 1.0 for s in systems if s != "none"}
            res["spread"] = {s: [min(v) / base - 1.0, max(v) / base - 1.0]
                             for s, v in runs.items() if s != "none"}
            res["cpu_overhead"] = {s: cmed[s] / cmed["none"] - 1.0
                                   for s in systems if s != "none"}
            bounds = {s: [_direct(r, base, busy) for r in ranks[s]]
                      for s in systems if s != "none"}
            res["stall_share"] = {s: statistics.median(b[0] for b in v)
                                  for s, v in bounds.items()}
            res["direct"] = {s: statistics.median(b[1] for b in v)
                             for s, v in bounds.items()}
            for key, over in (("cnr_over_dcp", res["overhead"]),
                              ("cnr_over_dcp_direct", res["direct"])):
                res[key] = (over["cnr"] / over["dcp_async"]
                            if over.get("dcp_async", 0) > 0 and "cnr" in over else None)
        out[str(every)] = res
        print("overhead every", every, json.dumps({k: v for k, v in res.items()
                                                   if k != "ranks"}), flush=True)
    return out


def _bytecode() -> None:
    """Compiled bytecode of cnrstore for the ranks, as an installed package has it (torch's
    and TorchRec's are compiled in site-packages): where PYTHONDONTWRITEBYTECODE is set
    (this machine), each rank would otherwise compile cnrstore's modules from source
    inside its timed restore (0.14 s a rank, measured), which dcp.load does not pay."""
    if os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    import compileall

    prefix = os.path.join(tempfile.gettempdir(), f"cnr-bench-pyc-{os.getuid()}")
    sys.pycache_prefix = prefix
    for pkg in ("cnrstore", "engine"):
        compileall.compile_dir(os.path.join(REPO, pkg), quiet=1)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix


def spawn(world: int, fn: str, *fargs: Any, timeout: float = 1800) -> Any:
    """Run this module's rank program ``fn`` on ``world`` spawned gloo ranks through
    bench_dist's plumbing (the one the other many-rank benches use): a rank leaves by
    ``os._exit`` once its result is written, so a crash in the interpreter's teardown (a
    spawned gloo rank here aborted there now and then, after all its work, with
    "terminate called without an active exception") cannot fail a finished run, and a
    rank's exception reaches the caller with its traceback instead of an exit code."""
    from benches.bench_dist import spawn as spawn_ranks

    os.environ["OMP_NUM_THREADS"] = "1"  # before the ranks import torch, as torchrun sets it
    _bytecode()
    program = fn if ":" in fn else f"benches.bench_torchrec:{fn}"
    return spawn_ranks(world, program, *fargs, timeout=timeout)


def run(a) -> dict:
    import torch

    parts = set(a.parts.split(","))
    root = a.root or tempfile.mkdtemp(prefix="bench_tr_", dir=a.out)
    os.makedirs(root, exist_ok=True)
    report: dict[str, Any] = {"args": vars(a), "systems": {}}
    total = sum(_hash(a)) * a.dim * 4
    report["table_bytes"] = total
    saved = os.path.join(root, "saves.json")
    if "save" in parts:
        for system in a.systems.split(","):
            saves = spawn(a.world, "_save", a, root, system)[0]
            report["systems"][system] = {"saves": saves, "restore_s": None}
            print(system, json.dumps(report["systems"][system]), flush=True)
        with open(saved, "w") as f:
            json.dump({"args": vars(a), "systems": report["systems"]}, f)
    elif os.path.exists(saved):
        with open(saved) as f:
            got = json.load(f)
        if any(got["args"][k] != getattr(a, k) for k in ("rows", "dim", "world", "checkpoints",
                                                         "train")):
            raise SystemExit(f"{root} holds checkpoints of other sizes: {got['args']}")
        report["systems"] = got["systems"]
    # Restores interleaved, cnrstore and DCP in each repeat; the median of each.
    restores: dict[str, list[float]] = {s: [] for s in ("cnr", "dcp")
                                        if s in report["systems"] and "restore" in parts}
    if restores:
        got = spawn(a.restore_world, "_restores", a, root, list(restores))
        for system in restores:
            for i in range(a.repeat):
                ranks = [g[system][i] for g in got]
                restores[system].append(max(r["restore_all_s"] for r in ranks))
                report["systems"][system].setdefault("restore_ranks", []).append(ranks)
                print("restore", system, json.dumps(ranks), flush=True)
    for system, times in restores.items():
        report["systems"][system]["restore_s"] = statistics.median(times)
        report["systems"][system]["restore_runs"] = times
    if "overhead" in parts and max(_steps(a).values()) > 0:
        report["overhead"] = overhead(a, root)
    same = None
    if os.path.exists(os.path.join(root, "restored_dcp_0.pt")) and os.path.exists(
            os.path.join(root, "restored_cnr_0.pt")):
        same = all(
            all(torch.equal(v, torch.load(os.path.join(root, f"restored_dcp_{r}.pt"))[k])
                for k, v in torch.load(os.path.join(root, f"restored_cnr_{r}.pt")).items())
            for r in range(a.restore_world))
    report["restores_agree"] = same
    if a.root is None:
        shutil.rmtree(root, ignore_errors=True)
    return report


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"TorchRec DLRMTrain, 4 tables, {report['table_bytes'] / 1e6:.0f} MB of weights "
             f"(+ row-wise Adagrad state), {a['world']} ranks save, {a['restore_world']} "
             f"restore under another plan; {a['train']} training steps between checkpoints.",
             "", "| system | first: bytes, stall, put | later (mean): bytes, stall, put | "
             "restore |", "| --- | --- | --- | --- |"]
    for name, r in report["systems"].items():
        s0, inc = r["saves"][0], r["saves"][1:]

        def mean(k: str, inc: list = inc) -> float:
            return sum(x[k] for x in inc) / max(1, len(inc))

        rest = f"{r['restore_s']:.2f} s" if r["restore_s"] is not None else "–"
        lines.append(f"| {name} | {s0['bytes'] / 1e6:.1f} MB, {s0['stall_s']:.2f} s, "
                     f"{s0['put_s']:.2f} s | {mean('bytes') / 1e6:.2f} MB, "
                     f"{mean('stall_s'):.2f} s, {mean('put_s'):.2f} s | {rest} |")
    c, d = report["systems"].get("cnr"), report["systems"].get("dcp")
    if c and d and c["restore_s"] is not None and d["restore_s"] is not None:
        lines.append(f"\nCold restore (median of {len(c['restore_runs'])}): cnrstore "
                     f"{c['restore_s']:.2f} s, dcp.load {d['restore_s']:.2f} s: "
                     f"{c['restore_s'] / d['restore_s']:.2f}x")
    lines.append(f"\nRestored rows of cnrstore and DCP identical: {report['restores_agree']}")
    if report.get("overhead"):
        lines += ["", f"Training overhead at {a['world']} ranks, wall time over the "
                  f"no-checkpoint run: median of {a['repeat']} runs [spread]; CPU: all "
                  "ranks' CPU seconds over the no-checkpoint run's (medians); direct: "
                  "bounds from each run's stalls and checkpoint CPU (medians; _direct):", "",
                  "| checkpoint every | steps | no checkpoint s | cnrstore (tracker, "
                  "non-blocking) | dcp.async_save | cnrstore / async_save | tracker alone "
                  "| cnrstore, no tracker |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]

        def pct(r: dict, k: str) -> str:
            if k not in r.get("overhead", {}):
                return "–"
            lo, hi = r["spread"][k]
            return (f"{r['overhead'][k] * 100:+.1f}% [{lo * 100:+.1f}, {hi * 100:+.1f}]; "
                    f"CPU {r['cpu_overhead'][k] * 100:+.1f}%; direct "
                    f"{r['stall_share'][k] * 100:.1f}-{r['direct'][k] * 100:.1f}%")

        for every, r in report["overhead"].items():
            ratio, direct = r.get("cnr_over_dcp"), r.get("cnr_over_dcp_direct")
            lines.append(f"| {every} | {r['steps']} | {r['median_s'].get('none', 0):.2f} | "
                         f"{pct(r, 'cnr')} | {pct(r, 'dcp_async')} | "
                         f"{'–' if ratio is None else f'{ratio:.2f}'}; direct "
                         f"{'–' if direct is None else f'{direct:.2f}'} | "
                         f"{pct(r, 'tracker')} | {pct(r, 'cnr_fp')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    report = run(a)
    with open(os.path.join(a.out, "bench_torchrec.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(a.out, "bench_torchrec.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0 if report["restores_agree"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())

"""``cnrstore demo --torchrec``: TorchRec's own DLRM on its random click dataset, sharded over
CPU ranks, checkpointed every N steps, SIGKILLed, resumed at another world size under
another sharding plan, and compared with an uninterrupted run.

Three jobs, each a group of spawned gloo ranks: the reference trains all steps at
``--world`` ranks; the interrupted job trains at ``--world`` ranks with a non-blocking
checkpoint every ``--every`` steps until this process SIGKILLs every rank at ``--fail-at``;
the resumed job opens the store at ``--resume-world`` ranks (another plan: the tables are
laid out by world size), restores the latest step with cnrstore.distributed.torchrec.load and
finishes. Both final states are then loaded into plain unsharded DLRMs in this one process
(load_unsharded) and evaluated on the same held-out batches.

The global batch is the same at every world size (each rank takes its slice), and TorchRec
and DDP average gradients over ranks, so the runs compute the same updates; between world
sizes only the order of floating-point sums differs, so the losses agree to ~1e-6, and at
the same world size (``--resume-world`` = ``--world``) bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["main", "add_arguments"]

HASH = [40_000, 20_000, 8_000, 2_000]
DIM = 16
DENSE_IN = 13
GLOBAL_BATCH = 120  # divisible by every world size 1..6
EVAL_BATCHES = 8
LAYOUTS = ("rw", "tw", "twrw", "tw")  # table i's sharding; table-wise ranks vary with i


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the TorchRec demo only (the rest are the demo's own: --steps, --every,
    --fail-at, --seed, --store, --quiet)."""
    parser.add_argument("--torchrec", action="store_true",
                        help="the TorchRec demo: DLRM over CPU ranks, resumed at another "
                        "world size (needs TorchRec: README, 'TorchRec')")
    parser.add_argument("--world", type=int, default=2,
                        help="--torchrec: ranks of the first job (default 2)")
    parser.add_argument("--resume-world", type=int, default=3,
                        help="--torchrec: ranks of the resumed job (default 3)")


# -- one rank ------------------------------------------------------------------------------

def model(world: int | None, hash_sizes=HASH, dim: int = DIM):
    """TorchRec's DLRMTrain, its tables on the meta device for a DMP (``world``) or on CPU."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM, DLRMTrain

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=n,
                                 feature_names=[f"f{i}"]) for i, n in enumerate(hash_sizes)]
    ebc = EmbeddingBagCollection(tables=tables,
                                 device=torch.device("meta" if world else "cpu"))
    return DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN,
                          dense_arch_layer_sizes=[32, dim], over_arch_layer_sizes=[32, 1]))


def plan(model, world: int):
    """Table i row-wise, table-wise or table-row-wise by LAYOUTS, as the world size allows."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    gens = {}
    n_tables = len(model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs())
    for i in range(n_tables):
        how = LAYOUTS[i % len(LAYOUTS)]
        gens[f"t{i}"] = (sp.row_wise() if how == "rw" else
                         sp.table_row_wise(host_index=0) if how == "twrw" else
                         sp.table_wise(rank=i % world))
    ebc = model.model.sparse_arch.embedding_bag_collection
    return ShardingPlan({"model.sparse_arch.embedding_bag_collection":
                         sp.construct_module_sharding_plan(ebc, gens, local_size=world,
                                                           world_size=world,
                                                           device_type="cpu")})


def batches(seed: int, start: int = 0, hash_sizes=HASH):
    """Global batch k of TorchRec's random click dataset, from ``start`` on."""
    from torchrec.datasets.random import RandomRecDataset

    keys = [f"f{i}" for i in range(len(hash_sizes))]
    it = iter(RandomRecDataset(keys=keys, batch_size=GLOBAL_BATCH, hash_sizes=list(hash_sizes),
                               ids_per_features=[3] * len(keys), num_dense=DENSE_IN,
                               manual_seed=seed, num_generated_batches=-1))
    for _ in range(start):
        next(it)
    yield from it


def local_part(batch, rank: int, world: int):
    """This rank's slice of the samples of a global batch."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    b = GLOBAL_BATCH
    lo, hi = rank * b // world, (rank + 1) * b // world
    kjt = batch.sparse_features
    lengths, values = [], []
    for k in kjt.keys():
        jt = kjt[k]
        off = jt.offsets()
        lengths.append(jt.lengths()[lo:hi])
        values.append(jt.values()[int(off[lo]):int(off[hi])])
    sparse = KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values),
                               lengths=torch.cat(lengths))
    return Batch(dense_features=batch.dense_features[lo:hi], sparse_features=sparse,
                 labels=batch.labels[lo:hi])


def _rank_main(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    import cnrstore
    from cnrstore.distributed import torchrec as ctr

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(job["seed"])
    net = model(world)
    apply_optimizer_in_backward(RowWiseAdagrad, net.model.sparse_arch.parameters(),
                                {"lr": 0.05})
    dmp = DistributedModelParallel(net, env=ShardingEnv(world, rank, dist.group.WORLD),
                                   device=torch.device("cpu"), plan=plan(net, world))
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    # dense part: plain SGD, stateless (the tables' optimizer is TorchRec's fused one)
    dense = torch.optim.SGD([p for _, p in in_backward_optimizer_filter(
        dmp.named_parameters())], lr=0.05)
    store = cnrstore.open(job["store"], group=dist.group.WORLD)
    start = 0
    if job["resume"]:
        start = store.steps()[-1]
        ctr.load(store, start, dmp)
    log = open(job["log"], "a") if rank == 0 else None
    if log:
        log.write(json.dumps({"event": "start", "step": start, "world": world}) + "\n")
    for k, batch in enumerate(batches(job["seed"], start), start):
        if k == job["steps"]:
            break
        loss, _ = dmp(local_part(batch, rank, world))
        dense.zero_grad()
        loss.backward()  # the fused optimizer updates the tables inside backward
        dense.step()
        step = k + 1
        if step % job["every"] == 0 or step == job["steps"]:
            t = time.perf_counter()
            fut = store.put_state(step, ctr.state_dict(dmp), blocking=step == job["steps"])
            stall = time.perf_counter() - t
            if log:
                log.write(json.dumps({"event": "put", "step": step, "stall": stall}) + "\n")
                if hasattr(fut, "add_done_callback"):
                    fut.add_done_callback(lambda f, s=step: _report(job["log"], s, f))
                else:
                    _report(job["log"], step, fut)
        if log:
            log.flush()
        if step == job.get("fail_at"):
            if rank == 0:
                Path(job["log"] + ".ready").write_text(str(step))
            while True:  # the driver SIGKILLs every rank here
                time.sleep(1)
    store.close()
    dist.destroy_process_group()
    if log:
        log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's teardown: with the store closed and the groups
    # destroyed nothing is left to do, and a spawned gloo rank's teardown now and then
    # aborted ("terminate called without an active exception", exit -6), which failed a
    # job whose every step had committed (benches/bench_dist.py's ranks leave alike).
    os._exit(0)


def _report(log: str, step: int, fut) -> None:
    try:
        info = fut.result() if hasattr(fut, "result") else fut
        rec = {"event": "committed", "step": step, "bytes": info.bytes_written}
    except BaseException as exc:  # noqa: BLE001 - a put cut short by the kill, say
        rec = {"event": "failed", "step": step, "error": repr(exc)}
    with open(log, "a") as f:
        f.write(json.dumps(rec) + "\n")


# -- the driver ----------------------------------------------------------------------------

def _job(world: int, job: dict[str, Any], *, kill: bool, timeout: float = 900) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, job)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    ready = Path(job["log"] + ".ready")
    while time.monotonic() < deadline:
        if kill and ready.exists():
            time.sleep(0.2)  # let a background put be in flight: the kill may cut it
            for p in procs:
                if p.pid is not None:
                    os.kill(p.pid, signal.SIGKILL)
            break
        if all(not p.is_alive() for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    bad = [p.exitcode for p in procs if p.exitcode not in (0, -signal.SIGKILL)]
    if bad or (not kill and any(p.exitcode != 0 for p in procs)):
        raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    if kill and not ready.exists():
        raise RuntimeError("the job ended before reaching --fail-at")


def evaluate(store_path: str, step: int, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Eval loss of ``step`` in a plain unsharded DLRM in this process, and its tables."""
    import cnrstore
    from cnrstore.distributed import torchrec as ctr

    net = model(None)
    with cnrstore.open(store_path) as store:
        ctr.load_unsharded(store, step, net)
    net.eval()
    losses = []
    with torch.no_grad():
        for _, batch in zip(range(EVAL_BATCHES), batches(seed + 10_000)):
            losses.append(float(net(batch)[0]))
    ebc = net.model.sparse_arch.embedding_bag_collection
    return sum(losses) / len(losses), {k: v.clone() for k, v in ebc.state_dict().items()}


def run(*, steps: int, every: int, fail_at: int, world: int, resume_world: int, seed: int,
        root: str, quiet: bool = False) -> dict:
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    ref: dict[str, Any] = {"store": f"{root}/reference", "log": f"{root}/reference.log",
                           "seed": seed, "steps": steps, "every": steps, "resume": False}
    job: dict[str, Any] = {"store": f"{root}/store", "log": f"{root}/job.log", "seed": seed,
                           "steps": steps, "every": every, "resume": False, "fail_at": fail_at}
    t0 = time.perf_counter()
    say(f"reference: {steps} steps at {world} ranks, uninterrupted")
    _job(world, ref, kill=False)
    t1 = time.perf_counter()
    say(f"job: {world} ranks, a checkpoint every {every} steps, SIGKILLed at step {fail_at}")
    _job(world, job, kill=True)
    say(f"resumed: {resume_world} ranks from the latest committed step")
    _job(resume_world, dict(job, resume=True, fail_at=None), kill=False)
    t2 = time.perf_counter()
    events = [json.loads(line) for line in open(job["log"])]
    resumed_from = [e["step"] for e in events if e["event"] == "start"][-1]
    puts = [e for e in events if e["event"] == "committed"]
    stalls = [e["stall"] for e in events if e["event"] == "put"]
    ref_loss, ref_tables = evaluate(ref["store"], steps, seed)
    loss, tables = evaluate(job["store"], steps, seed)
    diff = max(float((tables[k] - ref_tables[k]).abs().max()) for k in tables)
    from cnrstore.tools.info import disk_bytes

    result = {"steps": steps, "world": world, "resume_world": resume_world,
              "killed_at": fail_at, "resumed_from": resumed_from,
              "checkpoints": len(puts), "bytes_first": puts[0]["bytes"] if puts else 0,
              "bytes_later_mean": (sum(p["bytes"] for p in puts[1:]) / max(1, len(puts) - 1)),
              "stall_mean_s": sum(stalls) / max(1, len(stalls)),
              "store_bytes": disk_bytes(Path(job["store"])),
              "eval_loss_reference": ref_loss, "eval_loss_resumed": loss,
              "loss_diff": abs(loss - ref_loss), "max_table_diff": diff,
              "reference_s": t1 - t0, "interrupted_and_resumed_s": t2 - t1}
    return result


def main(args: argparse.Namespace) -> int:
    try:
        import torchrec  # noqa: F401
    except ImportError as exc:
        print(f"cnrstore demo --torchrec needs TorchRec ({exc}); see README, 'TorchRec'")
        return 2
    steps, every = args.steps, args.every
    fail_at = args.fail_at or max(every + 1, int(steps * 0.6) // every * every + every // 2)
    if not 0 < fail_at < steps or every < 1 or args.world < 1 or args.resume_world < 1:
        print("need 0 < --fail-at < --steps, --every >= 1 and world sizes >= 1")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = args.store or tmp
        Path(root).mkdir(parents=True, exist_ok=True)
        r = run(steps=steps, every=every, fail_at=fail_at, world=args.world,
                resume_world=args.resume_world, seed=args.seed, root=root, quiet=args.quiet)
    same = r["loss_diff"] == 0.0
    print(f"TorchRec DLRM, {r['steps']} steps: {r['world']} ranks, killed at step "
          f"{r['killed_at']}, resumed from step {r['resumed_from']} at {r['resume_world']} "
          f"ranks{' under another plan' if r['resume_world'] != r['world'] else ''}")
    print(f"  checkpoints {r['checkpoints']}: first {r['bytes_first']:,} B, later "
          f"{r['bytes_later_mean']:,.0f} B on average; stall {r['stall_mean_s'] * 1e3:.1f} ms;"
          f" store {r['store_bytes']:,} B")
    how = "identical" if same else f"diff {r['loss_diff']:.1e}"
    print(f"  eval loss: uninterrupted {r['eval_loss_reference']:.7f}, resumed "
          f"{r['eval_loss_resumed']:.7f} ({how}); tables differ by at most "
          f"{r['max_table_diff']:.1e}")
    ok = r["loss_diff"] <= 1e-4 * max(1.0, abs(r["eval_loss_reference"]))
    if r["world"] == r["resume_world"]:
        ok = same
    print("  OK" if ok else "  MISMATCH")
    return 0 if ok else 1

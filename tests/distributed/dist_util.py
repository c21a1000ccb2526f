"""Spawned ranks for the distributed store's tests: gloo on 127.0.0.1, one thread each.

``run(world, fn, *args)`` starts ``world`` processes running ``fn(rank, world, *args)``
(a module-level function of an importable module) and returns their results in rank
order; an exception in a rank comes back as ``Failed``. Every run has a deadline: ranks
still alive then are killed and the test fails, so nothing hangs the suite.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

from rankserver import context


@dataclass
class Failed:
    type: str
    message: str
    trace: str
    cls: Any = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(rank: int, world: int, port: int, out: str, env: dict, fn, args,
          hang_after: float) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(hang_after, exit=True)  # a hang shows where it hung
    os.environ.update(env.get("*", {}))
    os.environ.update(env.get(rank, {}))
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result: Any = fn(rank, world, *args)
    except BaseException as exc:  # reported, compared by the test
        result = Failed(type(exc).__name__, str(exc), traceback.format_exc(), type(exc))
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.rename(out + ".tmp", out)
    # No destroy_process_group: a rank whose peers died would wait on them.
    os._exit(0)


def run(world: int, fn, *args, timeout: float = 90.0, env: dict | None = None,
        expect_dead: tuple[int, ...] = ()) -> list[Any]:
    ctx = context()
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="cnr-dist-")
    outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
    procs = [ctx.Process(target=_main, args=(r, world, port, outs[r], env or {}, fn, args,
                                             max(1.0, timeout - 5)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    if hung:
        raise AssertionError(f"ranks {hung} still ran after {timeout} s (a hang)")
    results = []
    for r, path in enumerate(outs):
        if r in expect_dead:
            assert procs[r].exitcode != 0, f"rank {r} was to die but exited {procs[r].exitcode}"
            results.append(None)
            continue
        if not os.path.exists(path):
            raise AssertionError(f"rank {r} exited {procs[r].exitcode} without a result")
        with open(path, "rb") as f:
            results.append(pickle.load(f))
    return results


def survivors(res: list, victim: int) -> list[tuple]:
    """The results (err, seconds, closing, closed) of ``killed`` on every rank but
    ``victim``, each checked to have failed its put with RankFailed."""
    out = []
    for r, got in enumerate(res):
        if r == victim:
            continue
        assert not isinstance(got, Failed), got.trace
        err, seconds, closing, closed = got
        assert err is not None and err[0] == "RankFailed", err
        out.append(got)
    return out


def located(where: Any, rank: int | None = None) -> tuple[str, dict]:
    """A store location as the tests pass it to ranks: a path (a directory store), or a
    dict ``{"path", "cache", "options"}`` for a bucket or a shared directory whose index
    cache is ``cache`` formatted with the rank (each "host" its own; only the
    coordinator's is ever made). Returns (location, cnrstore.open keywords)."""
    if not isinstance(where, dict):
        return where, {}
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    kw: dict = {"cache_dir": where["cache"].format(rank=rank)}
    if where.get("options"):
        kw["storage_options"] = dict(where["options"])
    return where["path"], kw


# -- a deterministic training sequence, and how ranks hold it ----------------------------

BLOCK_ROWS = 32
FANOUT = 4


def zipf_rows(g, n: int, k: int):
    import torch

    p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(p, k, replacement=False, generator=g)


def sequence(seed: int, steps: int = 3):
    """[(step, {name: full table}, quant)] of a small training run with Zipf updates."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t = {
        "user": torch.randn(517, 6, generator=g),
        "item": torch.randn(300, 4, generator=g),
        "dense": torch.randn(40, 3, generator=g),
        "tw": torch.randn(70, 5, generator=g).to(torch.float16),
        "ids": torch.randint(0, 1000, (90,), generator=g),
        "empty": torch.zeros(0, 4),
    }
    out = []
    for i in range(steps):
        if i:
            for name in ("user", "item", "tw"):
                x = t[name]
                rows = zipf_rows(g, x.shape[0], max(1, x.shape[0] // 20))
                x[rows] += torch.randn(len(rows), *x.shape[1:], generator=g).to(x.dtype)
            t["ids"][zipf_rows(g, 90, 4)] += 1
        out.append((10 * (i + 1), {k: v.clone() for k, v in t.items()},
                    {"user": "int8", "item": "exact", "tw": "fp16"}))
    return out


def cuts(rows: int, world: int, seed: int) -> list[int]:
    """Uneven row boundaries, some shards empty."""
    import torch

    g = torch.Generator().manual_seed(seed + rows)
    inner = sorted(torch.randint(0, rows + 1, (world - 1,), generator=g).tolist())
    return [0, *inner, rows]


def rank_tables(tables: dict, rank: int, world: int, seed: int = 0) -> dict:
    """This rank's view: user uneven row-wise, item interleaved chunks (several shards),
    dense replicated, tw table-wise on the last rank, ids row-wise even, empty sharded."""
    import cnrstore

    out: dict = {}
    c = cuts(517, world, seed)
    out["user"] = cnrstore.Shard(tables["user"][c[rank]:c[rank + 1]], row_offset=c[rank],
                                 rows=517)
    chunks = [(lo, min(lo + 45, 300)) for lo in range(0, 300, 45)]
    mine = [cnrstore.Shard(tables["item"][lo:hi], row_offset=lo, rows=300)
            for i, (lo, hi) in enumerate(chunks) if i % world == rank]
    out["item"] = mine or [cnrstore.Shard(tables["item"][:0], row_offset=0, rows=300)]
    out["dense"] = tables["dense"]
    if rank == world - 1:
        out["tw"] = tables["tw"]
    per = -(-90 // world)
    lo, hi = min(90, rank * per), min(90, (rank + 1) * per)
    out["ids"] = cnrstore.Shard(tables["ids"][lo:hi], row_offset=lo, rows=90)
    out["empty"] = cnrstore.Shard(tables["empty"], row_offset=0, rows=0)
    return out


def oracle(path: str, seed: int, steps: int = 3) -> list[dict]:
    """Table ids of single-process puts of the assembled tables."""
    import cnrstore

    ids = []
    with cnrstore.open(path, block_rows=BLOCK_ROWS, fanout=FANOUT) as s:
        for step, tables, quant in sequence(seed, steps):
            ids.append(s.put_tables(step, tables, quant=quant).tables)
    return ids


def put_sequence(rank: int, world: int, path: str, seed: int, steps: int = 3,
                 blocking: bool = True) -> list[dict]:
    import torch.distributed as dist

    import cnrstore

    ids = []
    path, kw = located(path)
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=30, **kw) as s:
        futs = []
        for step, tables, quant in sequence(seed, steps):
            r = s.put_tables(step, rank_tables(tables, rank, world, seed), quant=quant,
                             blocking=blocking)
            futs.append(r)
        for r in futs:
            ids.append((r if blocking else r.result()).tables)
    return ids


def oracle_reopened(path: str, seed: int, steps: int = 4) -> list[dict]:
    """Single-process ids (and bytes written) when the last step is put from a fresh
    handle (seeded)."""
    import cnrstore

    seq = sequence(seed, steps)
    ids, written = [], []
    for part in (seq[:-1], seq[-1:]):
        with cnrstore.open(path, block_rows=BLOCK_ROWS, fanout=FANOUT) as s:
            for step, tables, quant in part:
                info = s.put_tables(step, tables, quant=quant)
                ids.append(info.tables)
                written.append(info.bytes_written)
    return ids, written


def put_reopened(rank: int, world: int, path: str, seed: int, steps: int = 4):
    """put_sequence with the last step put from a freshly opened distributed store;
    returns (ids, bytes written by the last put)."""
    import torch.distributed as dist

    import cnrstore

    seq = sequence(seed, steps)
    ids = []
    path, kw = located(path)
    for part in (seq[:-1], seq[-1:]):
        with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS,
                           fanout=FANOUT, timeout=30, **kw) as s:
            for step, tables, quant in part:
                info = s.put_tables(step, rank_tables(tables, rank, world, seed), quant=quant,
                                    blocking=False).result()
                ids.append(info.tables)
    return ids, info.bytes_written, info.logical_bytes

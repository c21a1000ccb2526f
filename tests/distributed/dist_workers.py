"""Rank programs of the distributed store's tests (module-level: spawned ranks import
them by name)."""

from __future__ import annotations

import os
import time

import torch
from dist_util import BLOCK_ROWS, FANOUT, located

import cnrstore


def _table(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(200, 4, generator=g)


def _mine(t: torch.Tensor, rank: int, world: int) -> cnrstore.Shard:
    cut = [0, 77, 200] if world == 2 else [round(200 * i / world) for i in range(world + 1)]
    return cnrstore.Shard(t[cut[rank]:cut[rank + 1]], row_offset=cut[rank], rows=200)


def _open(path: str, timeout: float = 20.0):
    import torch.distributed as dist

    path, kw = located(path)  # a path, or a bucket / shared directory with caches
    return cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                         timeout=timeout, **kw)


def bad_input(rank: int, world: int, path: str, how: str):
    """Step 1 fine; step 2 with rank 1's input bad in ``how``: every rank must raise the
    same error class, and no step 2 appears; step 3 then works."""
    with _open(path) as s:
        s.put_tables(1, {"t": _mine(_table(1), rank, world)}, quant="int8")
        t = _table(2)
        tables = {"t": _mine(t, rank, world)}
        if rank == 1 and how == "nan":
            t[150, 2] = float("nan")
        elif rank == 1 and how == "gap":
            tables = {"t": cnrstore.Shard(t[80:200], row_offset=80, rows=200)}
        elif rank == 1 and how == "dtype":
            tables = {"t": cnrstore.Shard(t[77:200].double(), row_offset=77, rows=200)}
        elif rank == 1 and how == "type":
            tables = {"t": "not a tensor"}
        quant = "int4" if rank == 1 and how == "quant" else "int8"
        try:
            s.put_tables(2, tables, quant=quant)
            err = None
        except cnrstore.CheckpointError as exc:
            err = (type(exc).__name__, str(exc))
        steps = s.steps()
        info = s.put_tables(3, {"t": _mine(_table(3), rank, world)}, quant="int8")
        return err, steps, info.tables, s.steps()


def killed(rank: int, world: int, path: str, victim: int, point: str):
    """Step 1 fine; during step 2's commit rank ``victim`` SIGKILLs itself at ``point``:
    the others must raise RankFailed within the timeout."""
    s = _open(path, timeout=15.0)
    s.put_tables(1, {"t": _mine(_table(1), rank, world)})
    if rank == victim:
        os.environ["CNRSTORE_CRASH_AT"] = point
    t0 = time.monotonic()
    try:
        s.put_tables(2, {"t": _mine(_table(2), rank, world)})
        err = None
    except cnrstore.CheckpointError as exc:
        err = (type(exc).__name__, str(exc))
    seconds = time.monotonic() - t0
    s.close()  # must not wait on the dead rank
    try:
        s.steps()
    except cnrstore.CheckpointError as exc:
        closed = str(exc)
    return err, seconds, time.monotonic() - t0 - seconds, closed


def maintain(rank: int, world: int, path: str):
    """Every maintenance call is collective: the same result (or error) on every rank."""
    out: dict = {}
    with _open(path) as s:
        for step in (1, 2, 3):
            s.put_tables(step, {"t": _mine(_table(step), rank, world)},
                         metadata={"lr": 0.1 * step})
        out["steps"] = s.steps()
        s.delete_step(2)
        out["after_delete"] = s.steps()
        try:
            s.delete_step(2)
        except cnrstore.CheckpointError as exc:
            out["delete_again"] = type(exc).__name__
        out["rollback"] = s.rollback(1)
        info = s.put_tables(4, {"t": _mine(_table(4), rank, world)}, metadata={"lr": 0.4})
        out["tables4"] = info.tables
        rep = s.gc(keep_last=1)
        out["gc"] = (rep.steps_deleted, rep.steps_kept)
        out["verify"] = s.verify().ok
        out["stats"] = s.stats().steps
        out["metadata"] = s.metadata(4)
        try:
            s.rollback(99)
        except cnrstore.CheckpointError as exc:
            out["rollback_missing"] = type(exc).__name__
        # after gc the bases of dropped blocks are forgotten; the next put still works
        out["tables5"] = s.put_tables(5, {"t": _mine(_table(5), rank, world)}).tables
        out["back"] = torch.equal(s.get_tables(5, names=["t"])["t"], _table(5))
        whole = torch.empty(200, 4)
        s.get_tables(5, out={"t": whole})  # a plain tensor: the whole table, in place
        out["out_whole"] = torch.equal(whole, _table(5))
        state = {"t": torch.zeros(200, 4), "extra": torch.zeros(3)}
        try:
            s.load_state(5, state)
        except cnrstore.CheckpointError as exc:
            out["strict"] = type(exc).__name__
        s.load_state(5, state, strict=False)
        out["lenient"] = torch.equal(state["t"], _table(5)) and not state["extra"].any()
    return out


def layouts(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {"rw": torch.randn(333, 5, generator=g),
            "tw": torch.randn(64, 3, generator=g),
            "tw2": torch.randint(0, 9, (50, 2), generator=g),
            "dense": torch.randn(7, generator=g)}


def save_layouts(rank: int, world: int, path: str):
    """Row-wise (uneven), table-wise (one table per rank) and replicated tables."""
    with _open(path) as s:
        for step in (1, 2):
            t = layouts(step)
            cut = [0, 100, 333]
            tables = {"rw": cnrstore.Shard(t["rw"][cut[rank]:cut[rank + 1]],
                                           row_offset=cut[rank], rows=333),
                      "dense": t["dense"]}
            tables["tw" if rank == 0 else "tw2"] = t["tw" if rank == 0 else "tw2"]
            s.put_tables(step, tables)
    return True


def restore_layouts(rank: int, world: int, path: str):
    """Each rank reads its even share of every table's rows, via rows=, out=Shard and
    load_state with Shards; plus the whole of one table."""
    full = layouts(2)
    with _open(path) as s:
        rows, outs = {}, {}
        for name, t in full.items():
            n = t.shape[0]
            lo, hi = n * rank // world, n * (rank + 1) // world
            rows[name] = slice(lo, hi)
            outs[name] = cnrstore.Shard(torch.empty_like(t[lo:hi]), row_offset=lo, rows=n)
        got = s.get_tables(2, names=list(full), rows=rows)
        filled = s.get_tables(2, out=outs)
        state = {n: cnrstore.Shard(torch.zeros_like(full[n][rows[n]]),
                                   row_offset=rows[n].start, rows=full[n].shape[0])
                 for n in full}
        s.load_state(2, state)
        whole = s.get_tables(None, names=["tw"])["tw"]
        ok = {n: (torch.equal(got[n], full[n][rows[n]]),
                  torch.equal(filled[n].local, full[n][rows[n]]),
                  torch.equal(state[n].local, full[n][rows[n]])) for n in full}
        return ok, torch.equal(whole, full["tw"])


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(200 + step)
    return {"model": {"emb.weight": torch.randn(90, 4, generator=g),
                      "rep.weight": torch.randn(12, 3, generator=g),
                      "bias": torch.randn(5, generator=g)},
            "optim": {"state": {0: {"step": torch.tensor(float(step))}}},
            "epoch": step}


def dtensor_state(rank: int, world: int, path: str):
    """put_state of DTensor leaves (row-sharded and replicated) and plain tensors, then
    load_state into fresh zero DTensors, and get_state."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def wrap(st: dict) -> dict:
        m = st["model"]
        return {"model": {"emb.weight": distribute_tensor(m["emb.weight"], mesh, [Shard(0)]),
                          "rep.weight": distribute_tensor(m["rep.weight"], mesh,
                                                          [Replicate()]),
                          "bias": m["bias"]},
                "optim": st["optim"], "epoch": st["epoch"]}

    ids = []
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=30) as s:
        for step in (1, 2):
            ids.append(s.put_state(step, wrap(state_of(step)),
                                   quant={"model/*": "int8"}).tables)
        fresh = wrap(state_of(0))
        for t in (fresh["model"]["emb.weight"], fresh["model"]["rep.weight"],
                  fresh["model"]["bias"]):
            t.to_local().zero_() if hasattr(t, "to_local") else t.zero_()
        back = s.load_state(2, fresh)
        whole = s.get_state(2)
    m = back["model"]
    return (ids, back["epoch"], m["emb.weight"].to_local().clone(),
            m["rep.weight"].to_local().clone(), m["bias"].clone(), whole)


def tiling_tables(rows: int, seed: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, 3, generator=g)
    if step > 1 and rows:
        idx = torch.randint(0, rows, (max(1, rows // 10),), generator=g)
        t[idx] += 1.0
    return t


def tiling_put(rank: int, world: int, path: str, spec: dict):
    """Puts of one table tiled as ``spec["pieces"][rank]`` (a list of (lo, hi))."""
    import torch.distributed as dist

    ids = []
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=spec["block_rows"],
                       fanout=3, timeout=30) as s:
        for step in (1, 2):
            t = tiling_tables(spec["rows"], spec["seed"], step)
            mine = [cnrstore.Shard(t[lo:hi], row_offset=lo, rows=spec["rows"])
                    for lo, hi in spec["pieces"][rank]]
            if not mine:
                mine = [cnrstore.Shard(t[:0], row_offset=0, rows=spec["rows"])]
            ids.append(s.put_tables(step, {"t": mine}, quant=spec["quant"]).tables)
    return ids


def hung(rank: int, world: int, path: str, victim: int):
    """Rank ``victim`` stops answering (it never enters step 2's put): the others must
    raise RankFailed once the store's timeout passes, not hang."""
    s = _open(path, timeout=2.0)
    s.put_tables(1, {"t": _mine(_table(1), rank, world)})
    if rank == victim:
        time.sleep(6)
        return "slept"
    t0 = time.monotonic()
    try:
        s.put_tables(2, {"t": _mine(_table(2), rank, world)})
        err = None
    except cnrstore.CheckpointError as exc:
        err = type(exc).__name__
    return err, time.monotonic() - t0


def touched_put(rank: int, world: int, path: str):
    """Puts with ``touched=`` (global row ids of this rank's own rows) on every rank."""
    t = _table(1)
    ids = []
    with _open(path) as s:
        ids.append(s.put_tables(1, {"t": _mine(t, rank, world)}).tables)
        rows = torch.tensor([3, 76, 77, 78, 150, 199])
        t[rows] += 1.0
        lo, hi = _mine(t, rank, world).row_offset, _mine(t, rank, world).row_end
        mine = rows[(rows >= lo) & (rows < hi)]
        info = s.put_tables(2, {"t": _mine(t, rank, world)}, touched={"t": mine})
        ids.append(info.tables)
        return ids, info.rows_changed, info.rows_written


def failing(rank: int, world: int, path: str, victim: int, point: str):
    """Rank ``victim``'s write of step 2 fails at ``point`` as a full disk would: every
    rank raises the same WriteFailed, no step 2 appears, and step 3 then works."""
    with _open(path) as s:
        s.put_tables(1, {"t": _mine(_table(1), rank, world)})
        if rank == victim:
            os.environ["CNRSTORE_DIST_FAIL_AT"] = point
        try:
            s.put_tables(2, {"t": _mine(_table(2), rank, world)}, blocking=False).result()
            err = None
        except cnrstore.CheckpointError as exc:
            err = (type(exc).__name__, str(exc))
        os.environ.pop("CNRSTORE_DIST_FAIL_AT", None)
        info = s.put_tables(3, {"t": _mine(_table(3), rank, world)})
        return err, s.steps(), info.tables, s.verify().ok


def bad_state(rank: int, world: int, path: str):
    """put_state where rank 1's state is malformed: every rank raises the same error."""
    with _open(path) as s:
        state = state_of(1)
        if rank == 1:
            state["model"][("tuple", "key")] = torch.zeros(3)
        try:
            s.put_state(1, state)
            err = None
        except cnrstore.CheckpointError as exc:
            err = type(exc).__name__
        try:
            s.put_state(2, state_of(2) if rank == 0 else [state_of(2)])
            err2 = None
        except cnrstore.CheckpointError as exc:
            err2 = type(exc).__name__
        return err, err2, s.steps()


def count_listings(rank: int, world: int, path: str, seed: int) -> int:
    """Issue 13: only the coordinator lists the bucket. Counts, in this rank's process,
    every listing of the storage (commit documents, packs) over a whole sequence of
    puts, a restore, gc and verify; rank 0's count shows the counter sees listings."""
    import torch.distributed as dist
    from dist_util import put_sequence

    from engine.storage import s3, shared

    calls = [0]
    for cls in (s3.S3Backend, shared.SharedBackend):
        for name in ("list",):
            real = getattr(cls, name)

            def counted(self, *a, _real=real, **kw):
                calls[0] += 1
                return _real(self, *a, **kw)

            setattr(cls, name, counted)
    put_sequence(rank, world, path, seed)
    loc, kw = located(path)
    with cnrstore.open(loc, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=30, **kw) as s:
        s.get_tables(s.steps()[-1])
        s.gc()
        assert s.verify().ok
    return calls[0]


def _rows_for(src: int, dest: int, k: int) -> torch.Tensor:
    """Rows rank ``src`` sends rank ``dest`` as its message ``k``: fp16 then fp32, some
    with no rows, odd counts of 6-byte rows (so the next message is off alignment)."""
    g = torch.Generator().manual_seed(100 * src + 10 * dest + k)
    n = (src + 2 * dest + 3 * k) % 4
    return torch.randn(n, 3, generator=g).to((torch.float16, torch.float32)[k % 2])


def exchange_rows(rank: int, world: int):
    """Each rank sends two messages to every other rank through Comm.exchange; returns the
    bytes received from each rank and whether every message arrived bit for bit."""
    from cnrstore.codec.layout import dtype_name
    from cnrstore.distributed import layout
    from cnrstore.distributed.comm import Comm

    def table(t):
        return layout.GlobalTable("t", int(t.shape[0]), tuple(t.shape[1:]),
                                  dtype_name(t.dtype), ((0, 0, int(t.shape[0])),))

    comm = Comm(list(range(world)), 30.0)
    out = [[_rows_for(rank, d, k) for k in range(2)] if d != rank else []
           for d in range(world)]
    buf, sizes = layout.pack(out)
    inbound = [[_rows_for(s, rank, k) for k in range(2)] if s != rank else []
               for s in range(world)]
    expect = [sum(layout.message_nbytes(table(t), t.shape[0]) for t in ts) for ts in inbound]
    got = comm.exchange(buf, sizes, expect, "test: exchange")
    exact = True
    for ts, data in zip(inbound, got):
        for t in ts:
            back, used = layout.unpack(data, table(t), t.shape[0])
            exact &= back.dtype == t.dtype and torch.equal(back, t)
            data = data[used:]
        exact &= data.numel() == 0
    comm.close()
    return [int(g.numel()) for g in got], expect, exact


def _count_reads(counts: dict) -> None:
    """Count, in this process, the read-ahead hints and the window locates (a
    ``locate_closure`` from a decode thread) of both kinds of object source, the
    coordinator's pack store and a rank's located view; the real calls still run."""
    import threading

    import engine

    def wrap(cls, name, key, decode_only):
        real = getattr(cls, name)

        def counted(self, *a, **k):
            if not decode_only or "decode" in threading.current_thread().name:
                counts[key] = counts.get(key, 0) + 1
            return real(self, *a, **k)
        setattr(cls, name, counted)

    for cls in (engine.PackStore, engine.LocatedObjects):
        wrap(cls, "prefetch", "hint", False)
        wrap(cls, "prefetch_at", "hint", False)
        wrap(cls, "locate_closure", "window", True)


def load_state_reads(rank: int, world: int, path: str):
    """load_state of row-sharded leaves (and one whole table) at a patch-chained step:
    (counts of hints and windows during the load, restored exactly)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(5)
    full = {"emb": torch.randn(200, 4, generator=g), "acc": torch.randn(200, 4, generator=g),
            "bias": torch.randn(7, generator=g)}
    cut = [0, 90, 200]
    lo, hi = cut[rank], cut[rank + 1]
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=30) as s:
        for step in (1, 2, 3):
            for n in ("emb", "acc"):
                full[n][step::16] += 1.0
            s.put_state(step, {n: cnrstore.Shard(full[n][lo:hi].clone(), row_offset=lo,
                                                 rows=200) for n in ("emb", "acc")}
                        | {"bias": full["bias"]})
        state = {n: cnrstore.Shard(torch.zeros(hi - lo, 4), row_offset=lo, rows=200)
                 for n in ("emb", "acc")} | {"bias": torch.zeros(7)}
        counts: dict = {}
        _count_reads(counts)
        s.load_state(3, state)
        ok = all(torch.equal(state[n].local, full[n][lo:hi]) for n in ("emb", "acc"))
        return counts, ok and torch.equal(state["bias"], full["bias"])


def put_state_rounds(rank: int, world: int, path: str, quant=None) -> list:
    """Rounds of the calling thread's group (``comm``; the writer has its own) in a
    non-blocking put_state of row-sharded leaves whose boundary blocks hold both ranks'
    rows (uneven cut), a plain tensor and a Python value; the second put diffs against
    the first's bases with touched rows. (rounds of each put, steps stored, restored:
    exactly, or for ``quant`` within its error)."""
    out = []
    t = {n: _table(i) for i, n in enumerate(("emb", "acc"))}
    with _open(path) as s:
        for step in (1, 2):
            for n in t:
                t[n][step::9] += 1.0
            state = {"model": {n: _mine(t[n].clone(), rank, world) for n in t},
                     "bias": torch.arange(7.0) + step, "epoch": step}
            mine = _mine(t["emb"], rank, world)
            ids = torch.arange(step, 200, 9)
            ids = ids[(ids >= mine.row_offset) & (ids < mine.row_offset + mine.local.shape[0])]
            touched = {f"model/{n}": ids for n in t}
            r0 = s.comm.rounds
            fut = s.put_state(step, state, blocking=False, quant=quant,
                              touched=touched if step > 1 else None)
            out.append(s.comm.rounds - r0)
            fut.result()
        back = s.get_state(2)
        same = torch.equal if quant is None else (
            lambda a, b: torch.allclose(a, b, atol=0.05))
        ok = all(same(back["model"][n], t[n]) for n in t) and back["epoch"] == 2
        return [out, s.steps(), ok]


def late_failure(rank: int, world: int, path: str, where: str = "pack"):
    """Rank 1 fails after the put's check round, packing the boundary rows it moves (no
    round of its own follows), or ``where="plan"`` planning its runs: every rank must
    raise its error (from the writer's first round: an exact table's put takes no width
    round, so every rank's non-blocking put returns a Future), and the next put works.
    (error, steps, whether this rank's put returned)."""
    from cnrstore.core import put as core_put
    from cnrstore.distributed import layout

    with _open(path) as s:
        s.put_tables(1, {"t": _mine(_table(1), rank, world)})
        pack, plan = layout.pack, core_put.plan_table
        if rank == 1 and where == "pack":
            def failing_pack(messages, out=None):
                raise MemoryError("no memory for the send buffer (test)")
            layout.pack = failing_pack
        if rank == 1 and where == "plan":
            def failing_plan(*args, **kwargs):
                raise MemoryError("no memory for the codes (test)")
            core_put.plan_table = failing_plan
        err, returned = None, False
        try:
            fut = s.put_tables(2, {"t": _mine(_table(2), rank, world)}, blocking=False)
            returned = True
            fut.result()
        except Exception as exc:  # noqa: BLE001 - compared by the test
            err = (type(exc).__name__, str(exc))
        finally:
            layout.pack, core_put.plan_table = pack, plan
        s.put_tables(3, {"t": _mine(_table(3), rank, world)})
        return err, s.steps(), returned


def check_round_payload(rank: int, world: int, path: str) -> list:
    """Types in each rank's payload of a tracker-driven put's check round, whose boundary
    blocks hold both ranks' rows (the rows moved and which of them changed ride it).
    (types found, restored)."""
    t = _table(0)
    seen: set = set()
    with _open(path) as s:
        gather = s.comm.all_gather  # agree's too; a put_state's cached structure's alone

        def spy(payload, what):
            if what == "put_tables: check":
                def walk(v):
                    seen.add(type(v).__module__.split(".")[0] + "." + type(v).__name__)
                    for x in (v.values() if isinstance(v, dict) else
                              v if isinstance(v, (list, tuple)) else ()):
                        walk(x)
                walk(payload)
            return gather(payload, what)

        s.comm.all_gather = spy
        s.put_state(1, {"emb": _mine(t.clone(), rank, world)})
        t[2::9] += 1.0
        mine = _mine(t, rank, world)
        ids = torch.arange(2, 200, 9)
        ids = ids[(ids >= mine.row_offset) & (ids < mine.row_offset + mine.local.shape[0])]
        s.put_state(2, {"emb": _mine(t.clone(), rank, world)}, blocking=False,
                    touched={"emb": ids}).result()
        return [sorted(seen), torch.equal(s.get_state(2)["emb"], t)]


def changing_structure(rank: int, world: int, path: str) -> list:
    """put_state of steps 1-4 where the structure changes on rank 1 only at step 2 (an
    optimizer state appears there: rank 1 holds all its rows) and rank 0's input is bad
    at step 3 (a gap in a table's shards) while rank 1's structure changes back: the
    structure of step 1 is taken again at step 2 until the check round, where every rank
    finds rank 1's changed and agrees it in the structure round. (the caller's rounds of
    each put, each step's error or None, steps stored, each stored step restored as
    given)."""
    rounds, errors, given = [], [], {}
    with _open(path) as s:
        for step in (1, 2, 3, 4):
            emb = _table(step)
            opt = _table(10 + step)
            state: dict = {"model": {"emb": _mine(emb, rank, world)}, "epoch": step}
            if rank == 1 and step in (2, 4):
                state["opt"] = {"m": cnrstore.Shard(opt, row_offset=0, rows=200)}
            if rank == 0 and step == 3:
                mine = _mine(emb, rank, world)
                state["model"]["emb"] = cnrstore.Shard(mine.local[1:], row_offset=1,
                                                       rows=200)
            r0 = s.comm.rounds
            err = None
            try:
                s.put_state(step, state, blocking=False).result()
                given[step] = (emb, opt if step in (2, 4) else None)
            except Exception as exc:  # noqa: BLE001 - compared by the test
                err = type(exc).__name__
            rounds.append(s.comm.rounds - r0)
            errors.append(err)
        ok = []
        for step, (emb, opt) in given.items():
            back = s.get_state(step)
            good = torch.equal(back["model"]["emb"], emb) and back["epoch"] == step
            if opt is None:
                good &= "opt" not in back
            else:
                good &= torch.equal(back["opt"]["m"], opt)
            ok.append(bool(good))
        return [rounds, errors, s.steps(), ok]


def tracked_steps(seed: int, steps: int):
    """(table, touched rows) of each step of a run whose hot rows change again and again,
    the touched rows also holding some looked up and not changed: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    t = _table(1)
    hot = torch.randint(0, 200, (40,), generator=g)
    out = [(t.clone(), None)]
    for _ in range(steps - 1):
        changed = torch.cat([hot[torch.randint(0, 40, (12,), generator=g)],
                             torch.randint(0, 200, (4,), generator=g)])
        t[changed] += 1.0
        out.append((t.clone(), torch.cat([changed, torch.randint(0, 200, (5,), generator=g)])))
    return out


def deferred_puts(rank: int, world: int, path: str, max_chain: int):
    """Non-blocking tracker-driven puts, planned on the writer thread, each rank's table
    overwritten with the next step's values as soon as its put returns: the step ids."""
    import torch.distributed as dist

    run = tracked_steps(7, 14)
    t = run[0][0].clone()
    mine = _mine(t, rank, world)  # a view of ``t``: the caller's table, as a DMP's
    lo, hi = mine.row_offset, mine.row_end
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       max_chain=max_chain, timeout=20.0) as s:
        futs = [s.put_tables(1, {"t": mine}, blocking=False)]
        for step, (values, touched) in enumerate(run[1:], start=2):
            t.copy_(values)
            own = touched[(touched >= lo) & (touched < hi)]
            futs.append(s.put_tables(step, {"t": mine}, blocking=False, touched={"t": own}))
        t.fill_(float("nan"))
        return [f.result().tables for f in futs], s.verify().ok


def deferred_failing(rank: int, world: int, path: str, victim: int,
                     point: str = "dist.rank_after_plan"):
    """Rank ``victim``'s writer fails after planning the first run of a deferred plan
    (two tables): every rank's Future fails with the same WriteFailed, and the next
    tracker-driven put stores its step (its values read back)."""
    import torch.distributed as dist

    tabs = {n: _table(i) for i, n in ((1, "a"), (2, "b"))}
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=20.0) as s:
        s.put_tables(1, {n: _mine(t, rank, world) for n, t in tabs.items()})
        rows = torch.tensor([3, 76, 77, 78, 150, 199])
        for t in tabs.values():
            t[rows] += 1.0
        mine = {n: _mine(t, rank, world) for n, t in tabs.items()}
        own = {n: rows[(rows >= m.row_offset) & (rows < m.row_end)] for n, m in mine.items()}
        if rank == victim:
            os.environ["CNRSTORE_DIST_FAIL_AT"] = point
        try:
            s.put_tables(2, mine, blocking=False, touched=own).result()
            err = None
        except cnrstore.CheckpointError as exc:
            err = (type(exc).__name__, str(exc))
        os.environ.pop("CNRSTORE_DIST_FAIL_AT", None)
        for t in tabs.values():
            t[rows] += 1.0
        s.put_tables(3, mine, blocking=False, touched=own).result()
        back = s.get_tables(3, names=list(tabs))
        same = all(torch.equal(back[n], t) for n, t in tabs.items())
        return err, s.steps(), same, s.verify().ok

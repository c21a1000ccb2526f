"""Rank programs of tests/distributed/test_dist_parity.py (module-level: spawned ranks
import them by name): what a DistributedStore offers as CheckpointStore does."""

from __future__ import annotations

import torch
from dist_util import BLOCK_ROWS, FANOUT
from tiny_model import TinyNet, train_steps

import cnrstore


def _open(path: str, **kw):
    import torch.distributed as dist

    return cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                         timeout=30.0, **kw)


def _err(fn) -> tuple[str, str] | None:
    try:
        fn()
    except cnrstore.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


def leaves_of_one_rank(rank: int, world: int, path: str) -> dict:
    """Rank 1 gives leaves rank 0 lacks: a plain tensor (a table-wise table it alone
    holds), a Python value and a whole sub-dict; what get_state returns on every rank."""
    out: dict = {}
    with _open(path) as s:
        state: dict = {"model": {"shared": torch.ones(4, 2)}, "epoch": 3}
        if rank == 1:
            state["model"]["mine"] = torch.arange(8.0).reshape(4, 2)
            state["loader"] = {"pos": 17, "name": "r1"}
        s.put_state(1, state)
        got = s.get_state(1)
        out["model"] = sorted(got["model"])
        out["mine"] = got["model"].get("mine")
        out["loader"] = got.get("loader")
        out["epoch"] = got["epoch"]
        # Each rank restores its own leaves in place, as it gave them.
        dest: dict = {"model": {"shared": torch.zeros(4, 2)}, "epoch": 0}
        if rank == 1:
            dest["model"]["mine"] = torch.zeros(4, 2)
            dest["loader"] = {"pos": 0, "name": ""}
        back = s.load_state(1, dest)
        out["back"] = (back["epoch"], back.get("loader"),
                       None if rank == 0 else torch.equal(dest["model"]["mine"],
                                                          state["model"]["mine"]))
        # Ranks that give one path as a tensor and as a dict: refused before anything is
        # written, on every rank.
        clash: dict = {"x": torch.ones(2, 2)} if rank == 0 else {"x": {"y": torch.ones(2, 2)}}
        out["clash"] = _err(lambda: s.put_state(2, clash))
        out["steps"] = s.steps()
    return out


class Calls(list):
    """A progress callback recording its calls."""

    def __call__(self, done: int, total: int) -> None:
        self.append((done, total))


def _table(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(256, 8, generator=g)


def progress_per_rank(rank: int, world: int, path: str) -> dict:
    """Each rank's ``progress`` calls of every call that takes one (rows split evenly:
    block-aligned shards, so a rank's own work is its own rows)."""
    lo, hi = (32 * round(8 * r / world) for r in (rank, rank + 1))  # 8 blocks of 32 rows
    out: dict = {"own": (hi - lo) * 8 * 4}

    def mine(step: int) -> cnrstore.Shard:
        return cnrstore.Shard(_table(step)[lo:hi].clone(), row_offset=lo, rows=256)

    with _open(path, progress_min_bytes=1024) as s:
        c = Calls()
        s.put_tables(1, {"t": mine(1)}, progress=c)
        out["put_tables"] = list(c)
        c = Calls()
        s.put_state(2, {"m": {"t": mine(2)}, "epoch": 2}, blocking=False, progress=c).result()
        s.steps()
        out["put_state"] = list(c)
        c = Calls()
        s.get_tables(1, names=["t"], rows={"t": slice(lo, hi)}, progress=c)
        out["get_tables rows"] = list(c)
        c = Calls()
        dest = cnrstore.Shard(torch.empty(hi - lo, 8), row_offset=lo, rows=256)
        s.get_tables(1, out={"t": dest}, progress=c)
        out["get_tables out"] = (list(c), torch.equal(dest.local, _table(1)[lo:hi]))
        c = Calls()
        s.get_state(2, progress=c)  # every rank reads the whole table
        out["get_state"] = list(c)
        c = Calls()
        dest = cnrstore.Shard(torch.empty(hi - lo, 8), row_offset=lo, rows=256)
        s.load_state(2, {"m": {"t": dest}, "epoch": 0}, progress=c)
        out["load_state"] = (list(c), torch.equal(dest.local, _table(2)[lo:hi]))
        for name, call in [("verify", lambda p: s.verify(progress=p)),
                           ("gc", lambda p: s.gc(keep_last=1, progress=p))]:
            c = Calls()
            call(c)
            out[name] = list(c)
        # A bad progress on one rank only: refused on every rank, nothing written.
        bad = "not callable" if rank == world - 1 else None
        out["bad"] = [_err(lambda: s.put_tables(3, {"t": mine(3)}, progress=bad)),
                      _err(lambda: s.get_state(progress=bad)),
                      _err(lambda: s.gc(keep_last=0, progress=bad)),
                      _err(lambda: s.verify(progress=bad))]
        out["steps"] = s.steps()
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
            a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


def fresh_adam(rank: int, world: int, path: str) -> dict:
    """A model and Adam saved after 3 steps; a fresh model and a fresh Adam (no state)
    restored with load_state on every rank; then one more step on both."""
    model = TinyNet(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)
    train_steps(model, opt, range(3))
    with _open(path) as s:
        s.put_state(3, {"model": model.state_dict(), "optim": opt.state_dict()})
        fresh = TinyNet(1)
        fopt = torch.optim.Adam(fresh.parameters(), lr=0.5)
        got = s.load_state(3, {"model": fresh.state_dict(), "optim": fopt.state_dict()})
    fopt.load_state_dict(got["optim"])
    out = {"restored": _same(fresh.state_dict(), model.state_dict())
           and _same(fopt.state_dict(), opt.state_dict())}
    train_steps(model, opt, [3])
    train_steps(fresh, fopt, [3])
    out["stepped"] = (_same(fresh.state_dict(), model.state_dict())
                      and _same(fopt.state_dict(), opt.state_dict()))
    return out


def dtensor_adam(rank: int, world: int, path: str) -> dict:
    """CheckpointManager.restore of a fresh Adam over a row-sharded DTensor parameter
    (FSDP2's layout): the restored state is that parameter's layout, and trains on alike."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def make(seed: int):
        torch.manual_seed(seed)
        p = torch.nn.Parameter(distribute_tensor(torch.randn(64, 4), mesh, [Shard(0)]))
        return p, torch.optim.Adam([p], lr=0.01)

    def train(p, opt, steps) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            target = distribute_tensor(torch.randn(64, 4, generator=g), mesh, [Shard(0)])
            opt.zero_grad()
            ((p - target) ** 2).sum().full_tensor().backward()
            opt.step()

    p, opt = make(0)
    train(p, opt, range(3))
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=30) as s:
        mgr = cnrstore.CheckpointManager(s)
        mgr.save(3, {"p": {"w": p}, "optim": opt})
        mgr.wait()
        q, fopt = make(1)
        mgr.restore(into={"p": {"w": q}, "optim": fopt})
    st = fopt.state[q]
    out = {"layout": {k: isinstance(v, DTensor) for k, v in st.items()}
           == {k: isinstance(v, DTensor) for k, v in opt.state[p].items()},
           "restored": all(torch.equal(st[k].to_local(), opt.state[p][k].to_local())
                           for k in ("exp_avg", "exp_avg_sq"))
           and torch.equal(st["step"], opt.state[p]["step"])
           and torch.equal(q.to_local(), p.to_local())}
    train(p, opt, [3])
    train(q, fopt, [3])
    out["stepped"] = torch.equal(q.to_local(), p.to_local())
    return out

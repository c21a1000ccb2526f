"""Spawned ranks for test_dist_partial_state.py: loads of part of a state on many ranks,
recording every object id each rank reads (the coordinator from its pack store, the
others through the located view they were sent)."""

from __future__ import annotations

import torch
from dist_util import BLOCK_ROWS, FANOUT

import cnrstore
import engine


def state_of(step: int) -> dict:
    g = torch.Generator().manual_seed(300 + step)
    return {"model": {"emb.weight": torch.randn(200, 4, generator=g),
                      "big.weight": torch.randn(256, 8, generator=g),
                      "bias": torch.randn(5, generator=g)},
            "optim": {"state": {0: {"sum": torch.randn(200, 4, generator=g)}},
                      "param_groups": [{"lr": 0.5 * step}]},
            "epoch": step}


def _record(seen: list, obj, names: tuple[str, ...]) -> None:
    for name in names:
        inner = getattr(obj, name)

        def wrapped(first, *a, _inner=inner, name=name, **kw):
            if name.endswith("_at"):
                seen.extend(bytes(x.oid) for x in ([first] if name != "prefetch_at"
                                                   else list(first)))
            elif name in ("get_many", "prefetch"):
                first = [bytes(o) for o in first]
                seen.extend(first)
            else:
                seen.append(bytes(first))
            return _inner(first, *a, **kw)

        setattr(obj, name, wrapped)


def partial(rank: int, world: int, path: str):
    """put_state of a state with a row-sharded DTensor leaf; then get_state and load_state
    with names= (each rank its own), and a pattern matching nothing, on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def wrap(st: dict) -> dict:
        st["model"]["emb.weight"] = distribute_tensor(st["model"]["emb.weight"], mesh,
                                                      [Shard(0)])
        return st

    seen: list[bytes] = []
    if rank != 0:
        orig = engine.LocatedObjects._loc

        def loc(self, oid):
            seen.append(bytes(oid))
            return orig(self, oid)

        engine.LocatedObjects._loc = loc  # type: ignore[method-assign]
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=BLOCK_ROWS, fanout=FANOUT,
                       timeout=30) as s:
        s.put_state(1, wrap(state_of(1)))
        if rank == 0:
            _record(seen, s.local.objects, ("get", "get_many", "get_at", "get_into",
                                            "get_into_at", "prefetch", "prefetch_at"))
        seen.clear()
        picks = ["model/emb.weight", "epoch"] if rank == 0 else ["model/big.*"]
        part = s.get_state(1, names=picks)
        read_get = set(seen)
        seen.clear()
        dest = wrap(state_of(0))
        dest["model"]["emb.weight"].to_local().zero_()
        dest["optim"]["state"][0]["sum"].zero_()
        back = s.load_state(None, dest, names=["model/emb.weight", "optim/param_groups/*"])
        read_load = set(seen)
        try:
            s.get_state(1, names=["model/*", "nothing*"] if rank == 1 else ["epoch"])
            err = None
        except cnrstore.CheckpointError as exc:
            err = type(exc).__name__
    part["model"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                     for k, v in part["model"].items()}
    return (part, read_get, read_load, back["model"]["emb.weight"].to_local().clone(),
            back["optim"], bool(torch.count_nonzero(back["optim"]["state"][0]["sum"])),
            err)

"""Rank programs of test_dist_agreement.py (module-level: spawned ranks import them)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from tiny_model import TinyNet, train_steps

import cnrstore


def _err(fn) -> tuple[str, str] | None:
    try:
        fn()
    except cnrstore.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


def _open(path: str, timeout: float = 20.0):
    return cnrstore.open(path, group=dist.group.WORLD, block_rows=8, timeout=timeout)


def mismatched_calls(rank: int, world: int, path: str):
    """Rank 0 makes one steps() call more; later, the ranks call different methods, one
    that starts with a broadcast: every rank must raise CollectiveMismatch at once."""
    out = []
    s = _open(path)
    s.put_tables(1, {"t": torch.ones(16, 2)})
    t0 = time.monotonic()
    if rank == 0:
        out.append(_err(s.steps))
    out.append(_err(lambda: s.put_tables(2, {"t": torch.zeros(16, 2)})))
    out.append(_err(s.steps))  # the handle is unusable now
    out.append(time.monotonic() - t0)
    s.close()
    s = _open(path)
    t0 = time.monotonic()
    out.append(_err(lambda: s.get_tables(1) if rank == 0 else s.steps()))
    out.append(time.monotonic() - t0)
    s.close()
    with _open(path) as s:  # a new handle works; the mismatched put wrote nothing
        out.append(s.steps())
    return out


def missing_rank_at_open(rank: int, world: int, path: str):
    if rank == 1:
        time.sleep(5)  # alive, but never opens the store
        return None
    t0 = time.monotonic()
    err = _err(lambda: _open(path, timeout=2))
    return err, time.monotonic() - t0


def checked_input(rank: int, world: int, path: str):
    """Replicas that differ, too-deep states, destinations a restore cannot write, and
    the guide's resume pattern with a fresh Adam, on a distributed store."""
    out: dict = {}
    with _open(path) as s:
        s.put_tables(1, {"a": torch.ones(16, 2), "t": torch.arange(32.0).reshape(16, 2)})
        out["replica"] = _err(lambda: s.put_tables(2, {"dense": torch.full((4, 2), rank)}))
        out["same replica"] = _err(lambda: s.put_tables(2, {"dense": torch.ones(4, 2)}))
        deep: dict = {}
        for _ in range(100_000):
            deep = {"a": deep}
        out["deep put"] = _err(lambda: s.put_state(3, {"d": deep}))
        out["deep load"] = _err(lambda: s.load_state(2, {"d": deep}))
        first = torch.full((16, 2), -1.0)  # restored first if anything were
        bad = {"expand": torch.zeros(1, 2).expand(16, 2),
               "meta": torch.empty(16, 2, device="meta")}
        for kind, dest in bad.items():
            if rank == 0:  # one rank's bad destination fails the read on every rank
                dest = torch.zeros(16, 2)
            shard = cnrstore.Shard(dest[:8], row_offset=8 * rank, rows=16)
            for how, call in [("out", lambda d=dest: s.get_tables(1, out={"a": first, "t": d})),
                              ("shard", lambda d=shard: s.get_tables(1, out={"a": first,
                                                                             "t": d})),
                              ("load", lambda d=dest: s.load_state(1, {"a": first, "t": d}))]:
                out[f"{how} {kind}"] = _err(call)
        out["untouched"] = torch.equal(first, torch.full((16, 2), -1.0))

        model = TinyNet()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        train_steps(model, opt, range(3))
        s.put_state(4, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3})
        train_steps(model, opt, range(3, 5))
        fresh = TinyNet()
        fopt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        restored = s.load_state(None, {"model": fresh.state_dict(),
                                       "optim": fopt.state_dict(), "epoch": 0})
        fopt.load_state_dict(restored["optim"])
        train_steps(fresh, fopt, range(3, 5))
        out["resumed"] = all(torch.equal(a, b) for a, b in
                             zip(model.state_dict().values(), fresh.state_dict().values()))
        out["epoch"] = restored["epoch"]
        # A dict empty on one rank only (a table-wise table the other rank gives) is not
        # adopted: that rank would read a whole table it does not hold.
        s.put_state(5, {"model": {"tw": torch.ones(4, 2)} if rank == 0 else {}})
        got = s.load_state(5, {"model": {"tw": torch.zeros(4, 2)} if rank == 0 else {}})
        out["table-wise"] = sorted(got["model"])
    return out


def _rounds(s, fn) -> tuple[int, object]:
    """(rounds ``fn`` held on this rank, its result or its error)."""
    r0 = s.comm.rounds
    box: list = []
    err = _err(lambda: box.append(fn()))
    return s.comm.rounds - r0, err if err is not None else box[0]


def load_rounds(rank: int, world: int, path: str):
    """load_state's rounds where no rank's state holds an empty container (no adopt round:
    every rank knows from the structure round), and where one does; then the TorchRec
    load's structure round (statestore.structure) with the stored shapes riding it, on
    states that differ between ranks. Returns {case: (rounds, result or error)}."""
    out: dict = {}
    rows = 4 * world
    mine = torch.arange(4.0 * rank * 2, 4.0 * (rank + 1) * 2).reshape(4, 2)
    with _open(path) as s:
        s.put_state(1, {"model": {"w": cnrstore.Shard(mine, row_offset=4 * rank, rows=rows)},
                        "optim": {"state": {"w": torch.ones(3)}, "lr": 0.1}})

        def state(empty_on: int | None = None, shard: bool = True) -> dict:
            w = torch.zeros(4, 2)
            model = {"w": cnrstore.Shard(w, row_offset=4 * rank, rows=rows)} if shard else {}
            optim: dict = {"state": {} if rank == empty_on else {"w": torch.zeros(3)},
                           "lr": 0.0}
            return {"model": model, "optim": optim}

        given = state()

        def uniform():
            got = s.load_state(1, given)
            assert torch.equal(given["model"]["w"].local, mine)
            assert torch.equal(got["optim"]["state"]["w"], torch.ones(3))
            return got["optim"]["lr"]

        out["uniform"] = _rounds(s, uniform)

        def fresh():  # every rank a fresh optimizer: adopted on every rank
            got = s.load_state(1, state(empty_on=rank))
            return sorted(got["optim"]["state"]), got["optim"]["state"]["w"].tolist()

        out["fresh"] = _rounds(s, fresh)

        def last_empty():  # one rank's state differs: not adopted, as before
            got = s.load_state(1, state(empty_on=world - 1))
            return sorted(got["optim"]["state"])

        out["last empty"] = _rounds(s, last_empty)

        def made_empty():  # uniform makes rank >0's "model" {}: nothing adopted there
            got = s.load_state(1, {"model": {"w": torch.zeros(rows, 2)}} if rank == 0 else
                               {"optim": {"lr": 0.0}}, strict=False)
            return sorted(got), sorted(got.get("model", {"-": 0}))

        out["made empty"] = _rounds(s, made_empty)

        from cnrstore.distributed.torchrec import _shapes

        def agreed(st, step=1):
            a = s.structure(st, "test: structure", ask=lambda cs: _shapes(cs, step))
            got = s.load_agreed(1, a.state, a)
            return a.answer, a.no_empty, sorted(got)

        out["agreed"] = _rounds(s, lambda: agreed(state()))
        out["agreed, no step"] = _rounds(s, lambda: agreed(state(), step=7))
        out["agreed, not a mapping"] = _rounds(
            s, lambda: agreed(state() if rank == 0 else [torch.zeros(1)]))
        bad = {"model": {"w": cnrstore.Shard(torch.zeros(4, 2), row_offset=0,
                                             rows=rows + (rank == world - 1))}}
        if world > 1:
            out["agreed, another table"] = _rounds(s, lambda: agreed(bad))
    return out

"""Ranks for tests/distributed/test_dist_seam.py: the pipelines' seam (core/group.py)
on gloo against the world of one, which pipeline functions a put and a get run, and
the same gets answered alike by both handles."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

import cnrstore
import cnrstore.distributed.store  # noqa: F401 - imported before any trace: bodies of calls only
from cnrstore.core.group import Solo
from cnrstore.errors import InvalidInput, StepNotFound

PIPELINE = os.path.join("cnrstore", "core", "put.py")
GET_PIPELINE = os.path.join("cnrstore", "core", "get.py")


def _outcome(fn) -> Any:
    try:
        return ("ok", fn())
    except Exception as exc:  # compared by the test: the same type on both seams
        return ("err", type(exc).__name__)


def rounds(group: Any) -> list:
    """Every round the pipeline takes, with values and with errors, through ``group``."""
    def fail(exc: Exception):
        def raise_() -> Any:
            raise exc
        return raise_

    buf = torch.arange(24, dtype=torch.uint8)
    return [
        _outcome(lambda: group.all_gather({"a": [1, 2]}, "t: gather")),
        _outcome(lambda: group.agree(None, "t: agree", ("x", 3))),
        _outcome(lambda: group.agree(InvalidInput("bad input"), "t: agree err", 1)),
        _outcome(lambda: group.from_coordinator("t: scatter", lambda: [[7, 8]])),
        _outcome(lambda: group.from_coordinator("t: bcast", lambda: {"k": b"v"},
                                                scatter=False)),
        _outcome(lambda: group.from_coordinator("t: err", fail(StepNotFound(4)))),
        _outcome(lambda: [t.tolist() for t in group.exchange(buf, [24], [24], "t: x")]),
        (group.rank, group.world, group.coordinator),
    ]


def _tables(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(1000, 16, generator=g)
    emb[:step * 7] += step
    return {"emb": emb, "bias": torch.arange(300.0).reshape(100, 3) * step,
            "empty": torch.zeros(0, 4)}


def _puts(store: Any) -> list[dict]:
    out = []
    for step in (1, 2, 3):
        touched = {"emb": torch.arange(step * 7)} if step == 3 else None
        info = store.put_tables(step, _tables(step), quant={"emb": "int8", "*": "exact"},
                                touched=touched, metadata={"s": step})
        got = store.get_tables(step)
        out.append({"tables": info.tables, "rows_changed": info.rows_changed,
                    "rows_written": info.rows_written, "objects_new": info.objects_new,
                    "bytes_new": info.bytes_new,
                    "data": {n: t.numpy().tobytes() for n, t in got.items()}})
    return out


def world_of_one(rank: int, world: int, dist_path: str, plain_path: str) -> dict:
    """One gloo rank: Solo and Comm answer the same rounds the same way, and a
    DistributedStore of one rank writes what a CheckpointStore writes."""
    with cnrstore.open(dist_path, group=dist.group.WORLD, block_rows=128) as ds:
        seams = {"gloo": rounds(ds.comm), "solo": rounds(Solo())}
        distributed = _puts(ds)
        # The same store read back by a plain handle, then seeded: a later put of
        # each writes the same objects.
    with cnrstore.open(plain_path, block_rows=128) as cs:
        plain = _puts(cs)
    return {"seams": seams, "distributed": distributed, "plain": plain}


def _traced(fn, module: str = PIPELINE) -> set[str]:
    """The functions of ``module`` (core/put.py) that ``fn()`` runs, on any thread."""
    seen: set[str] = set()

    def hook(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.endswith(module):
            seen.add(frame.f_code.co_name)

    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return seen


def strategy_names(store: Any) -> list[str]:
    core = getattr(store, "_core", store)
    return [type(core.group).__name__, type(core.placement).__name__,
            type(core.commit).__name__, type(core.reader).__name__]


def pipeline_functions(rank: int, world: int, path: str) -> dict:
    """The functions of the pipeline a distributed put_tables and put_state run."""
    out: dict[str, Any] = {}

    def go() -> None:
        with cnrstore.open(path, group=dist.group.WORLD, block_rows=64) as ds:
            out["strategies"] = strategy_names(ds)
            t = _tables(1)["emb"]
            shard = cnrstore.Shard(t[rank * 500:(rank + 1) * 500], row_offset=rank * 500,
                                   rows=1000)
            ds.put_tables(1, {"emb": shard})
            ds.put_state(2, {"emb": shard, "epoch": 1}, blocking=False).result()

    out["functions"] = sorted(_traced(go))
    return out


def plain_pipeline_functions(path: str) -> dict:
    """The same for a CheckpointStore, in this process."""
    out: dict[str, Any] = {}

    def go() -> None:
        with cnrstore.open(path, block_rows=64) as cs:
            out["strategies"] = strategy_names(cs)
            t = _tables(1)["emb"]
            cs.put_tables(1, {"emb": t})
            cs.put_state(2, {"emb": t, "epoch": 1}, blocking=False).result()

    out["functions"] = sorted(_traced(go))
    return out


def _plain(value: Any) -> Any:
    """``value`` with tensors as (dtype, shape, bytes): comparable across processes."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape), value.numpy().tobytes())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _state(step: int) -> dict:
    t = _tables(step)
    return {"model": {"emb": t["emb"], "bias": t["bias"]}, "epoch": step,
            "optim": {"state": {}, "lr": [0.1]}}


def _fresh() -> dict:
    return {"model": {"emb": torch.zeros(1000, 16), "bias": torch.zeros(100, 3)},
            "epoch": 0, "optim": {"state": {}, "lr": [0.0]}}


def _gets(store: Any) -> list:
    """The gets both handles are asked, with results and with errors."""
    store.put_tables(1, _tables(1), quant={"emb": "int8", "*": "exact"})
    store.put_state(2, _state(2))

    def load() -> Any:
        dest = _fresh()
        got = store.load_state(2, dest)
        return got, dest

    return [_outcome(lambda fn=fn: _plain(fn())) for fn in (
        lambda: store.get_tables(1),
        lambda: store.get_tables(),  # the newest step: the state's tables
        lambda: store.get_tables(1, names=["emb"], rows={"emb": slice(10, 90)}),
        lambda: store.get_tables(1, rows={"bias": slice(5, 100, 3)}),
        lambda: store.get_tables(1, out={"emb": torch.empty(1000, 16)}),
        lambda: store.get_tables(1, out={"emb": torch.empty(10, 16)}),
        lambda: store.get_tables(9),
        lambda: store.get_tables(1, names=["nope"]),
        lambda: store.get_tables(1, rows={"nope": slice(0, 1)}),
        lambda: store.get_tables(1, rows={"emb": slice(0, 10, 0)}),
        lambda: store.get_tables(1, rows={"emb": 3}),
        lambda: store.get_tables(1, device="meta"),
        lambda: store.get_tables(-1),
        lambda: store.get_state(2),
        lambda: store.get_state(2, names=["model/*"]),
        lambda: store.get_state(1),
        lambda: store.get_state(2, names=["nothing/*"]),
        load,
        lambda: store.load_state(2, {"model": {"emb": torch.zeros(5, 16)}}),
        lambda: store.load_state(2, {"extra": torch.zeros(3)}, strict=False),
    )]


def gets_alike(rank: int, world: int, dist_path: str, plain_path: str) -> dict:
    """One gloo rank: a DistributedStore of one rank and a CheckpointStore answer the
    same gets with the same results and the same errors."""
    with cnrstore.open(dist_path, group=dist.group.WORLD, block_rows=128) as ds:
        distributed = _gets(ds)
    with cnrstore.open(plain_path, block_rows=128) as cs:
        plain = _gets(cs)
    return {"distributed": distributed, "plain": plain}


def _get_all(store: Any, rank: int) -> None:
    t = _tables(1)["emb"]
    shard = cnrstore.Shard(t[rank * 500:(rank + 1) * 500], row_offset=rank * 500, rows=1000)
    store.put_tables(1, {"emb": shard} if hasattr(store, "comm") else {"emb": t})
    store.put_state(2, {"emb": shard if hasattr(store, "comm") else t, "epoch": 1})


def get_functions(rank: int, world: int, path: str) -> dict:
    """The functions of core/get.py a distributed get_tables, get_state and load_state
    run (the puts before are not traced)."""
    out: dict[str, Any] = {}
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=64) as ds:
        out["strategies"] = strategy_names(ds)
        _get_all(ds, rank)
        dest = cnrstore.Shard(torch.zeros(500, 16), row_offset=rank * 500, rows=1000)

        def go() -> None:
            ds.get_tables(1, rows={"emb": slice(rank * 500, rank * 500 + 500)})
            ds.get_state(2)
            ds.load_state(2, {"emb": dest, "epoch": 0})

        out["functions"] = sorted(_traced(go, GET_PIPELINE))
    return out


def plain_get_functions(path: str) -> dict:
    """The same for a CheckpointStore, in this process."""
    out: dict[str, Any] = {}
    with cnrstore.open(path, block_rows=64) as cs:
        out["strategies"] = strategy_names(cs)
        _get_all(cs, 0)

        def go() -> None:
            cs.get_tables(1, rows={"emb": slice(0, 500)})
            cs.get_state(2)
            cs.load_state(2, {"emb": torch.zeros(1000, 16), "epoch": 0})

        out["functions"] = sorted(_traced(go, GET_PIPELINE))
    return out

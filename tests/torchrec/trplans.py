"""Workers and checks of the any-plan tests (test_torchrec_plans.py, test_torchrec_dcp.py):
DMPs under plans TorchRec's planner picks, saved at one world size and loaded at another.
Spawned ranks import this module by its name (tests/torchrec is on the path)."""

from __future__ import annotations

import os

import torch
import trmodels

# table -> sharding type; the planner is forced to each by ParameterConstraints
ALL7 = {"t0": "tw", "t1": "rw", "t2": "twrw", "t3": "cw", "t4": "twcw", "t5": "grid", "t6": "dp"}
ROWS7 = (20, 18, 11, 16, 13, 24, 9)
DIMS7 = (8, 4, 8, 16, 8, 16, 4)
EC4 = {"t0": "tw", "t1": "rw", "t2": "cw", "t3": "dp"}
ROWS4 = (20, 18, 11, 16)
ORDER = ["tw", "rw", "twrw", "cw", "twcw", "grid", "dp"]


def rotate(layout: dict, by: int, allowed=ORDER) -> dict:
    """Each table moved ``by`` places along the types ``allowed``: another plan."""
    return {t: allowed[(allowed.index(h) + by) % len(allowed)] for t, h in layout.items()}


def pieces_of(state) -> dict:
    """path -> (global shape, [(row, col, local)]) of this rank (None for a plain tensor,
    which every rank holds whole)."""
    from cnrstore.distributed.leaves import pieces
    from cnrstore.distributed.torchrec import _leaf_paths

    out = {}
    for path, leaf in _leaf_paths(state):
        got = pieces(leaf)
        if got is None:
            out[path] = (tuple(leaf.shape), None, leaf.detach().clone())
        else:
            shape = (leaf.rows, *leaf.local.shape[1:]) if hasattr(leaf, "rows") else leaf.shape
            out[path] = (tuple(int(d) for d in shape), [
                (r, c, t.detach().clone()) for t, r, c in got if t.numel()], None)
    return out


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's pieces; each element covered exactly once."""
    whole = {}
    for path in per_rank[0]:
        shape, _, plain = per_rank[0][path]
        if plain is not None:
            whole[path] = plain
            continue
        t = torch.zeros(shape, dtype=torch.float64)
        seen = torch.zeros(shape, dtype=torch.int64)
        dtype = None
        for r in per_rank:
            for row, col, local in r[path][1]:
                dtype = local.dtype
                view = local.reshape(local.shape[0], -1) if len(shape) > 1 else local
                idx = (slice(row, row + view.shape[0]),) + (
                    (slice(col, col + view.shape[1]),) if len(shape) > 1 else ())
                t[idx] = view.double()
                seen[idx] += 1
        assert bool(seen.eq(1).all()), f"{path}: elements covered {seen.unique().tolist()}"
        whole[path] = t.to(dtype or torch.float32)
    return whole


def env(local: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(local)


def models(world: int, layouts: dict, *, dtensor: bool, seed: int, local: int) -> dict:
    """kind -> DMP under the planner's plan for ``layouts[kind]``."""
    env(local)
    spec = {"ebc": dict(rows=ROWS7, dims=DIMS7, optim="rowwise"),
            "ec": dict(rows=ROWS4, dims=(8,) * 4, optim="full_adagrad"),
            "sgd": dict(rows=ROWS7[3:6], dims=DIMS7[3:6], optim="sgd")}
    out = {}
    for key, layout in layouts.items():
        s = dict(spec[key])
        kind = "ec" if key == "ec" else "ebc"
        out[key] = trmodels.dmp(kind, layout, world, dtensor=dtensor, seed=seed,
                                plan="planner", local=local, optim=s.pop("optim"), **s)
    return out


def train(ms: dict, rank: int, world: int, seeds) -> None:
    for s in seeds:
        for key, m in ms.items():
            kind = "ec" if key == "ec" else "ebc"
            rows = {"ebc": ROWS7, "ec": ROWS4, "sgd": ROWS7[3:6]}[key]
            trmodels.train_step(m, kind, trmodels.batch(kind, s, rows=rows, rank=rank,
                                                        world=world))


def state(ms: dict) -> dict:
    from cnrstore.distributed import torchrec as ctr

    return {k: ctr.state_dict(m) for k, m in ms.items()}


def expected_optim(saved: dict[str, torch.Tensor], loaded_shapes: dict[str, tuple]
                   ) -> dict[str, torch.Tensor]:
    """What a load under another plan gives each saved tensor: the tensor itself, or for
    a row-wise accumulator kept per column piece (k * rows entries) loaded as k' pieces,
    the mean of a row's k entries in each of its k' pieces (docs/TORCHREC.md)."""
    out = {}
    for path, t in saved.items():
        shape = loaded_shapes[path]
        if tuple(t.shape) == shape:
            out[path] = t
            continue
        parts = path.split("/")  # key/optim/state/<fqn>/<name>
        rows = saved[f"{parts[0]}/model/{parts[-2]}"].shape[0]
        k = t.shape[0] // rows
        out[path] = t.double().reshape(k, rows).mean(0).to(t.dtype).repeat(shape[0] // rows)
    return out


def check_equal(got: dict, want: dict, names=None) -> None:
    names = sorted(want) if names is None else names
    bad = {p: (tuple(got[p].shape), tuple(want[p].shape)) if got[p].shape != want[p].shape
           else float((got[p].double() - want[p].double()).abs().max())
           for p in names if not (got[p].shape == want[p].shape and torch.equal(got[p], want[p]))}
    assert not bad, bad


# -- the default suite: column-wise at 2 ranks, restored row-wise at 3 -------------------

SAVE2 = {"ebc": {"t3": "cw", "t4": "twcw", "t5": "tw", "t0": "tw", "t1": "rw", "t2": "tw",
                 "t6": "dp"}}
ROWWISE = {"ebc": {"t3": "rw", "t4": "rw", "t5": "rw", "t0": "tw", "t1": "rw", "t2": "tw",
                   "t6": "dp"}}
LOAD3 = {"ebc": {"t3": "rw", "t4": "tw", "t5": "cw", "t0": "cw", "t1": "tw", "t2": "rw",
                 "t6": "tw"}}


def save_worker(rank, world, path, path_b, path_cw, path_rw):
    import torch.distributed as dist
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig

    import cnrstore
    from cnrstore.distributed import torchrec as ctr

    ms = models(world, SAVE2, dtensor=False, seed=1, local=world)
    m = ms["ebc"]
    plan = {t: ps.sharding_type for t, ps in m.plan.plan["sparse"].items()}
    tracker = m.init_torchrec_delta_tracker(DeltaTrackerConfig())  # TorchRec's own
    a = cnrstore.open(path, group=dist.group.WORLD, block_rows=4)
    b = cnrstore.open(path_b, group=dist.group.WORLD, block_rows=4)
    train(ms, rank, world, [10, 11])
    a.put_state(1, state(ms), touched=tracker)
    b.put_state(1, state(ms))
    train(ms, rank, world, [12])
    ia = a.put_state(2, state(ms), touched=tracker)
    ib = b.put_state(2, state(ms))
    saved = pieces_of(state(ms))
    # what is still refused names the table and the plan: put_tables does not join columns
    import pytest

    from cnrstore.errors import InvalidInput

    w3 = m.state_dict()["sparse.embedding_bags.t3.weight"]
    with pytest.raises(InvalidInput, match=r"table 'cw'.*sharded by columns.*rows 0\.\.16 "
                                           r"cols \d+\.\.\d+.*put_state"):
        a.put_tables(9, {"cw": w3})
    note = ctr.plan_note(m, "'ebc/optim/state/sparse.embedding_bags.t3.weight/t3.momentum1'")
    ranks = m.plan.plan["sparse"]["t3"].ranks  # one per column piece (the planner's)
    assert note == f"this DMP's plan: t3: column_wise on ranks {ranks}", note
    # the same plan, other initial values: restored exactly, optimizer state included
    # ShardedTensor mode: TorchRec 1.9 cannot build the DTensor of a table-column-wise
    # table on a rank holding none of it (utils.create_global_tensor_shape_stride...)
    same = models(world, SAVE2, dtensor=False, seed=7, local=world)
    ctr.load(a, 2, same["ebc"], at="ebc")
    again = pieces_of(state(same))
    # a table's objects do not depend on the plan: the column-wise model's tables and a
    # row-wise model holding the same values (loaded from the step) put alike
    rw = models(world, ROWWISE, dtensor=False, seed=3, local=world)
    ctr.load(a, 2, rw["ebc"], optim=False, at="ebc")
    with cnrstore.open(path_cw, group=dist.group.WORLD, block_rows=4) as cw_store, \
            cnrstore.open(path_rw, group=dist.group.WORLD, block_rows=4) as rw_store:
        ic = cw_store.put_state(5, {"model": ms["ebc"].state_dict()})
        ir = rw_store.put_state(5, {"model": rw["ebc"].state_dict()})
    train(ms, rank, world, [13])
    train(same, rank, world, [13])
    after, after_same = pieces_of(state(ms)), pieces_of(state(same))
    a.close()
    b.close()
    return dict(plan=plan, saved=saved, again=again, after=after, after_same=after_same,
                tracked=(ia.tables, ib.tables, ia.bytes_new, ib.bytes_new),
                ids=(ic.tables, ir.tables),
                rw_plan={t: ps.sharding_type for t, ps in rw["ebc"].plan.plan["sparse"].items()})


def load_worker(rank, world, path, layouts, dtensor):
    import torch.distributed as dist

    import cnrstore
    from cnrstore.distributed import torchrec as ctr

    ms = models(world, layouts, dtensor=dtensor, seed=2, local=world)
    with cnrstore.open(path, group=dist.group.WORLD) as store:
        for key, m in ms.items():
            ctr.load(store, 2, m, at=key)
    plan = {t: ps.sharding_type for t, ps in ms["ebc"].plan.plan["sparse"].items()}
    return plan, pieces_of(state(ms))


# -- through DCP (cnrstore.dcp): a DMP's state_dict saved by dcp.save, loaded by dcp.load -

DCP_ST = {"ebc": {"t3": "cw", "t4": "twcw", "t5": "tw", "t0": "tw", "t1": "rw", "t2": "tw",
                  "t6": "dp"}}
# DTensor mode: no table-column-wise (TorchRec 1.9 fails to build its DTensor on a rank
# holding none of it)
DCP_DT = {"ebc": {"t3": "rw", "t4": "cw", "t5": "cw", "t0": "rw", "t1": "tw", "t2": "cw",
                  "t6": "dp"}}


def dcp_worker(rank, world, path, saves, loads):
    """``saves``/``loads``: [(step, layout, dtensor)]: each DMP's model state saved by
    dcp.save into ``step``, or loaded by dcp.load from it (other initial values)."""
    import torch.distributed.checkpoint as dcp

    from cnrstore.dcp import StorageReader, StorageWriter

    out = {}
    for step, layout, dtensor in saves:
        ms = models(world, layout, dtensor=dtensor, seed=step, local=world)
        train(ms, rank, world, [20 + step])
        sd = {"model": ms["ebc"].state_dict()}
        dcp.save(sd, storage_writer=StorageWriter(path, step=step))
        out[step] = pieces_of(sd)
    for step, layout, dtensor in loads:
        ms = models(world, layout, dtensor=dtensor, seed=50 + step, local=world)
        sd = {"model": ms["ebc"].state_dict()}
        dcp.load(sd, storage_reader=StorageReader(path, step=step))
        plan = {t: ps.sharding_type for t, ps in ms["ebc"].plan.plan["sparse"].items()}
        out[step] = (plan, pieces_of({"model": ms["ebc"].state_dict()}))
    return out


# -- the slow matrix: every type, EBC and EC, saved at 4 ranks (2 hosts), loaded at 1-3 --

MATRIX = {"ebc": ALL7, "ec": EC4, "sgd": {"t0": "cw", "t1": "twcw", "t2": "grid"}}
EC_TYPES = ["tw", "rw", "cw", "dp"]


def matrix_layouts(by: int) -> dict:
    return {"ebc": rotate(ALL7, by), "ec": rotate(EC4, by, EC_TYPES),
            "sgd": rotate(MATRIX["sgd"], by)}


def matrix_save(rank, world, path, local):
    import torch.distributed as dist

    import cnrstore

    ms = models(world, MATRIX, dtensor=False, seed=4, local=local)
    # the EC's lookup fails at 4 ranks as 2 hosts in TorchRec 1.9 (construct_jagged_tensors
    # splits a wrong length): its tables and state get values that say where they are
    train({k: m for k, m in ms.items() if k != "ec"}, rank, world, [30, 31])
    fill_where(state({"ec": ms["ec"]}))
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=4) as store:
        store.put_state(1, state(ms))
    return {k: {t: ps.sharding_type for t, ps in m.plan.plan["sparse"].items()}
            for k, m in ms.items()}, pieces_of(state(ms))


def matrix_load(rank, world, path, local, by, dtensor):
    import torch.distributed as dist

    import cnrstore
    from cnrstore.distributed import torchrec as ctr

    ms = models(world, matrix_layouts(by), dtensor=dtensor, seed=9, local=local)
    with cnrstore.open(path, group=dist.group.WORLD) as store:
        for key, m in ms.items():
            ctr.load(store, 1, m, at=key)
    return {k: {t: ps.sharding_type for t, ps in m.plan.plan["sparse"].items()}
            for k, m in ms.items()}, pieces_of(state(ms))


def fill_where(st) -> None:
    """Every sharded leaf of ``st`` filled with values that say where they are (trcheck)."""
    from trcheck import table

    from cnrstore.distributed.leaves import fill_leaf, is_sharded_leaf
    from cnrstore.distributed.torchrec import _leaf_paths

    for path, leaf in _leaf_paths(st):
        if is_sharded_leaf(leaf):
            whole = table(path, tuple(leaf.shape))
            fill_leaf(leaf, lambda lo, hi, w=whole: w[lo:hi])

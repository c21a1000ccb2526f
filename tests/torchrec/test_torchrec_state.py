"""put_state/load_state of TorchRec state through the distributed store: a DMP's tables and
fused optimizer state saved under one plan and world size, restored under another (and
into a plain unsharded module in one process), checked row by row; and the restored job
trains on exactly as the saved one does."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import torch  # noqa: E402
import trmodels  # noqa: E402
import trspawn  # noqa: E402

TIMEOUT = 240
SAVE = {"ebc": {"t0": "tw:1", "t1": "rw", "t2": "twrw"},
        "ec": {"t0": "tw:1", "t1": "rw", "t2": "tw:0"}}
LOAD3 = {"ebc": {"t0": "twrw", "t1": "tw:2", "t2": "rw"},
         "ec": {"t0": "rw", "t1": "tw:2", "t2": "rw"}}
OPTIM = {"ebc": "rowwise", "ec": "full_adagrad"}


def _pieces(state) -> dict:
    """path -> [(row offset, local rows)] of this rank, for assembling whole tables."""
    from cnrstore.distributed.leaves import shard_leaf
    from cnrstore.distributed.torchrec import _leaf_paths

    out = {}
    for path, leaf in _leaf_paths(state):
        shards = shard_leaf(leaf)
        if shards is None:
            out[path] = [(0, leaf.detach().clone(), True)]
        else:
            out[path] = [(s.row_offset, s.local.clone(), s.rows) for s in shards]
    return out


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    whole = {}
    for path in per_rank[0]:
        first = per_rank[0][path][0]
        if first[2] is True:  # replicated plain tensor
            whole[path] = first[1]
            continue
        rows = first[2]
        parts = sorted((o, t) for r in per_rank for o, t, _ in r[path] if t.shape[0])
        t = torch.cat([t for _, t in parts])
        starts = [0]
        for _, p in parts[:-1]:
            starts.append(starts[-1] + p.shape[0])
        assert [o for o, _ in parts] == starts and t.shape[0] == rows, (
            path, [(o, p.shape) for o, p in parts], rows)
        whole[path] = t
    return whole


def _models(world, layouts, dtensor, seed):
    return {k: trmodels.dmp(k, layouts[k], world, dtensor=dtensor, optim=OPTIM[k], seed=seed)
            for k in ("ebc", "ec")}


def _train(models, rank, world, seeds):
    for s in seeds:
        for kind, m in models.items():
            trmodels.train_step(m, kind, trmodels.batch(kind, s, rank=rank, world=world))


def _save_worker(rank, world, path):
    import torch.distributed as dist

    import cnrstore
    from cnrstore.distributed import torchrec as ctr
    models = _models(world, SAVE, False, seed=1)
    _train(models, rank, world, [10, 11, 12])
    store = cnrstore.open(path, group=dist.group.WORLD)
    state = {k: ctr.state_dict(m) for k, m in models.items()}
    store.put_state(1, state)
    # the same, as TorchRec gives it (each rank names only its tables' optimizer state)
    store.put_state(2, {k: {"model": m.state_dict(), "optim": m.fused_optimizer.state_dict()}
                        for k, m in models.items()})
    saved = _pieces(state)
    _train(models, rank, world, [13])  # what the restored job must reproduce
    after = _pieces({k: ctr.state_dict(m) for k, m in models.items()})
    assert store.steps() == [1, 2]  # column-wise plans: test_torchrec_plans.py
    store.close()
    return saved, after


def _load_worker(rank, world, path, layouts, dtensor):
    import torch.distributed as dist

    import cnrstore
    from cnrstore.distributed import torchrec as ctr
    from cnrstore.distributed.leaves import fill_leaf

    models = _models(world, layouts, dtensor, seed=2)  # other initial values
    store = cnrstore.open(path, group=dist.group.WORLD)
    store.load_state(2, {k: {"model": m.state_dict(), "optim": m.fused_optimizer.state_dict()}
                         for k, m in models.items()})
    raw = _pieces({k: ctr.state_dict(m) for k, m in models.items()})
    for m in models.values():  # scramble, so that step 1 must restore every row again
        for leaf in ctr.state_dict(m)["model"].values():
            fill_leaf(leaf, lambda lo, hi, t=leaf: torch.full((hi - lo, *t.shape[1:]), 7.0))
    store.load_state(1, {k: ctr.state_dict(m) for k, m in models.items()})
    loaded = _pieces({k: ctr.state_dict(m) for k, m in models.items()})
    # ctr.load holds one structure round (with the stored shapes), the request, the answer
    # and the closing round; a rank whose model has no fused optimizer fails it on every
    # rank (it raised alone, and the others waited in the DMP group's gather)
    r0 = store.comm.rounds
    ctr.load(store, 1, models["ebc"], at="ebc")
    rounds = [store.comm.rounds - r0]
    r0 = store.comm.rounds
    try:
        ctr.load(store, 1, models["ebc"] if rank else torch.nn.Linear(2, 2), at="ebc")
        err = None
    except cnrstore.CheckpointError as exc:
        err = (type(exc).__name__, str(exc))
    rounds.append(store.comm.rounds - r0)
    _train(models, rank, world, [13])
    after = _pieces({k: ctr.state_dict(m) for k, m in models.items()})
    store.close()
    return loaded, after, raw, rounds, err


def check_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    bad = {p: (a[p] - b[p]).abs().max().item() for p in a if not torch.equal(a[p], b[p])}
    assert not bad, bad


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("trstore") / "store")
    got = trspawn.run(_save_worker, 2, path, timeout=TIMEOUT)
    return path, assemble([g[0] for g in got]), assemble([g[1] for g in got])


def test_restore_at_three_ranks_under_another_plan_in_dtensor_mode(saved):
    path, before, after = saved
    # the optimizer state of every table is in the step, sharded like its table
    assert "ebc/optim/state/sparse.embedding_bags.t0.weight/t0.momentum1" in before
    assert before["ebc/optim/state/sparse.embedding_bags.t0.weight/t0.momentum1"].shape == (20,)
    assert before["ec/optim/state/sparse.embeddings.t1.weight/t1.momentum1"].shape == (18, 4)
    got = trspawn.run(_load_worker, 3, path, LOAD3, True, timeout=TIMEOUT)
    for g in got:
        assert g[3] == [4, 1], g[3]
        assert g[4] == ("InvalidType", "rank 0: Linear has no fused_optimizer; pass "
                        "optim=False"), g[4]
    check_equal(assemble([g[0] for g in got]), before)
    check_equal(assemble([g[2] for g in got]), before)  # the step put as TorchRec gives it
    # one more step from the restored state: the same as the saved job's next step, which
    # it is only if the fused optimizer's state was restored too
    check_equal(assemble([g[1] for g in got]), after)


def test_restore_into_plain_unsharded_modules_in_one_process(saved):
    import cnrstore
    from cnrstore.distributed import torchrec as ctr

    path, before, _ = saved
    with cnrstore.open(path) as store:  # no group: one process reads the sharded save
        for kind in ("ebc", "ec"):
            plain = trmodels.Sparse(trmodels.module(kind, device="cpu"))
            ctr.load_unsharded(store, 1, plain, at=f"{kind}/model")
            for k, v in plain.state_dict().items():
                torch.testing.assert_close(v, before[f"{kind}/model/{k}"], rtol=0, atol=0)
        # a bare EmbeddingBagCollection: the DMP's keys had "sparse." before its own
        bare = trmodels.module("ebc", device="cpu")
        ctr.load_unsharded(store, 1, bare, prefix="sparse.", at="ebc/model")
        for k, v in bare.state_dict().items():
            torch.testing.assert_close(v, before[f"ebc/model/sparse.{k}"], rtol=0, atol=0)

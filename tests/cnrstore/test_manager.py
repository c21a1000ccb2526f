"""cnrstore.CheckpointManager (cnrstore/tools/manager.py): the save policy (every N steps,
every T seconds on an injected clock), retention after each committed save (last K, every
M-th, best K by a reported metric, never the newest or a step being restored), wait and
latest_step, and a resumed training run equal bit for bit to an uninterrupted one, on
local, shared-directory, S3 and two-rank stores."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from _servers import moto_s3  # noqa: F401 - the fixture, registered by import
from dist_util import run
from hypothesis import given, settings
from hypothesis import strategies as st

import cnrstore
from cnrstore.tools.manager import plan_retention


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 4, generator=g)}


def _open(tmp_path, **kw):
    return cnrstore.open(tmp_path / "ckpt", block_rows=8, **kw)


# -- policy ------------------------------------------------------------------------------

def test_saves_every_n_steps(tmp_path):
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, save_interval_steps=5)
        saved = [step for step in range(1, 23) if mgr.save(step, _state(step))]
        mgr.wait()
        assert saved == [5, 10, 15, 20]
        assert s.steps() == [5, 10, 15, 20] == mgr.all_steps()
        assert mgr.save(21, _state(), force=True) and (mgr.wait() or True)
        assert mgr.latest_step() == 21


def test_saves_every_t_seconds_on_the_injected_clock(tmp_path):
    clock = Clock()
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, save_interval_seconds=60.0, clock=clock)
        saved = []
        for step in range(1, 20):
            clock.t += 25.0          # a save is due every third step: 75 s >= 60 s
            if mgr.save(step, _state(step)):
                saved.append(step)
        mgr.wait()
        assert saved == [3, 6, 9, 12, 15, 18]
        assert s.steps() == saved


def test_steps_or_seconds_whichever_comes_first(tmp_path):
    clock = Clock()
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, save_interval_steps=10,
                                         save_interval_seconds=100.0, clock=clock)
        saved = []
        for step in range(1, 31):
            clock.t += 60.0 if step > 20 else 1.0
            if mgr.save(step, _state()):
                saved.append(step)
        assert saved == [10, 20, 22, 24, 26, 28, 30]


def test_no_policy_saves_every_step_and_the_newest_step_is_not_saved_twice(tmp_path):
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s)
        assert mgr.save(1, _state()) and mgr.save(2, _state())
        assert not mgr.save(2, _state())           # a resumed loop reaching its step
        with pytest.raises(cnrstore.StepExists):
            mgr.save(1, _state())
        assert s.steps() == [1, 2]


@pytest.mark.parametrize("kwargs", [
    {"save_interval_steps": 0}, {"save_interval_seconds": -1.0}, {"max_to_keep": 0},
    {"keep_period": True}, {"keep_best": 2}, {"best_mode": "lowest"},
])
def test_bad_settings_are_refused_before_anything_is_written(tmp_path, kwargs):
    with _open(tmp_path) as s:
        with pytest.raises(cnrstore.InvalidInput):
            cnrstore.CheckpointManager(s, **kwargs)
        assert s.steps() == []


# -- retention ---------------------------------------------------------------------------

def test_keeps_the_last_k_and_every_m_th(tmp_path):
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, max_to_keep=2, keep_period=4)
        for step in range(1, 11):
            mgr.save(step, _state(step))
            # retention follows each commit: never more than the kept set plus one in flight
            assert len([x for x in s.steps() if x % 4]) <= 3
        mgr.wait()
        assert s.steps() == [4, 8, 9, 10] == mgr.all_steps()
        assert torch.equal(s.get_state(9)["w"], _state(9)["w"])


@pytest.mark.parametrize("mode,best", [("min", [3, 6]), ("max", [2, 5])])
def test_keeps_the_best_k_by_the_reported_metric(tmp_path, mode, best):
    losses = {1: 5.0, 2: 9.0, 3: 1.0, 4: 4.0, 5: 8.0, 6: 2.0, 7: 3.5, 8: 6.0}
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, max_to_keep=1, keep_best=2, best_metric="loss",
                                         best_mode=mode)
        for step, loss in losses.items():
            mgr.save(step, _state(step), metrics={"loss": loss})
        mgr.wait()
        assert s.steps() == sorted(best + [8])
        assert mgr.best_step() == best[0]
        assert mgr.metrics(8) == {"loss": 6.0}
    # The metrics live in the store: a new manager ranks the old steps the same.
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, max_to_keep=1, keep_best=1, best_metric="loss",
                                         best_mode=mode)
        mgr.save(9, _state(), metrics={"loss": 7.0}, force=True)
        mgr.wait()
        assert s.steps() == [best[0], 9]


def test_a_step_without_the_metric_is_kept_only_as_newest(tmp_path):
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, keep_best=1, best_metric="loss")
        mgr.save(1, _state(), metrics={"loss": 1.0})
        mgr.save(2, _state())
        mgr.save(3, _state(), metrics={"loss": float("nan")})
        mgr.save(4, _state(), metrics={"acc": 1.0})
        mgr.wait()
        assert s.steps() == [1, 4]


def test_gc_reclaims_the_dropped_steps_bytes(tmp_path):
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, max_to_keep=1, blocking=True)
        for step in range(1, 6):
            mgr.save(step, {"w": torch.randn(512, 16)})
        stats = s.stats()
        assert s.steps() == [5]
        assert stats.stored_bytes < 2 * 512 * 16 * 4


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=0, max_size=20, unique=True),
       st.one_of(st.none(), st.integers(1, 5)), st.one_of(st.none(), st.integers(1, 7)),
       st.one_of(st.none(), st.integers(1, 4)), st.sampled_from(["min", "max"]),
       st.data())
def test_retention_plan_properties(steps, last, period, best, mode, data):
    steps = sorted(steps)
    metrics = {s: data.draw(st.one_of(st.none(), st.fixed_dictionaries(
        {"m": st.floats(-5, 5)}))) for s in steps}
    protected = set(data.draw(st.lists(st.sampled_from(steps))) if steps else [])
    drop = plan_retention(steps, max_to_keep=last, keep_period=period, keep_best=best,
                          best_metric="m", best_mode=mode, metrics=metrics,
                          protected=protected)
    kept = set(steps) - set(drop)
    assert set(drop) <= set(steps)
    if not steps or (last is None and best is None):
        assert not drop
        return

    def score(s):
        m = metrics[s]
        return None if m is None else (m["m"] if mode == "min" else -m["m"])

    scored = sorted(score(s) for s in steps if score(s) is not None)
    cut = scored[min(best, len(scored)) - 1] if best and scored else None
    # what every rule keeps is kept...
    assert max(steps) in kept and protected <= kept
    assert set(steps[-last:] if last else []) <= kept
    assert {s for s in steps if period and s % period == 0} <= kept
    assert {s for s in steps if cut is not None and score(s) is not None
            and score(s) < cut} <= kept
    assert len({s for s in kept if cut is not None and score(s) is not None
                and score(s) <= cut}) >= min(best or 0, len(scored))
    # ...and nothing else
    for s in kept - {max(steps)} - protected:
        assert (last and s in steps[-last:]) or (period and s % period == 0) or (
            cut is not None and score(s) is not None and score(s) <= cut)


def test_a_step_being_restored_is_not_deleted(tmp_path):
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s, max_to_keep=1)
        mgr.save(1, _state(1))
        mgr.wait()
        entered, release = threading.Event(), threading.Event()

        class Slow(dict):
            """A restore target whose flattening waits: the restore is under way."""

            def items(self):
                entered.set()
                release.wait(10)
                return super().items()

        out = {}
        t = threading.Thread(target=lambda: out.update(
            mgr.restore(1, into=Slow(w=torch.zeros(16, 4)))))
        t.start()
        assert entered.wait(10)
        mgr.save(2, _state(2))
        mgr.save(3, _state(3))
        mgr.wait()
        assert s.steps() == [1, 3]       # 1 is being restored: kept; 2 went
        release.set()
        t.join(10)
        assert torch.equal(out["w"], _state(1)["w"])
        mgr.save(4, _state(4), force=True)
        mgr.wait()
        assert s.steps() == [4]


# -- non-blocking and errors -------------------------------------------------------------

def test_non_blocking_save_returns_before_the_commit_and_wait_commits(tmp_path):
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s)
        t = {"w": torch.randn(64, 8)}
        want = t["w"].clone()
        assert mgr.save(1, t)
        t["w"].add_(1.0)                 # the caller may modify its state at once
        assert mgr.latest_step() is None  # committed steps only, until wait()
        mgr.wait()
        assert mgr.latest_step() == 1
        assert torch.equal(s.get_state(1)["w"], want)


def test_a_failed_save_is_raised_and_not_recorded(tmp_path):
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s)
        mgr.save(1, _state())
        with pytest.raises(cnrstore.InvalidType):
            mgr.save(2, {"w": object()})
        mgr.wait()
        assert mgr.all_steps() == [1] == s.steps()
        with pytest.raises(cnrstore.InvalidInput):
            mgr.save(3, _state(), metrics={"loss": 1.0}, metadata={"metrics": 1})


def test_restore_of_an_empty_store_is_step_not_found(tmp_path):
    with _open(tmp_path) as s:
        with pytest.raises(cnrstore.StepNotFound):
            cnrstore.CheckpointManager(s).restore(into={"w": torch.zeros(2)})


# -- exact resume ------------------------------------------------------------------------

class Net(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(50, 8)
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.lin(self.emb(ids)).squeeze(-1)


def _train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 50, (32,), generator=g)
        y = torch.randn(32, generator=g)
        loss = (model(ids) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _equal_runs(a, a_opt, b, b_opt):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    sa, sb = a_opt.state_dict(), b_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st_a in sa["state"].items():
        for k, v in st_a.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
}


def _resume_check(store_factory, optim):
    make = OPTIMIZERS[optim]
    ref = Net(0)
    ref_opt = make(ref.parameters())
    _train(ref, ref_opt, range(1, 21))

    first = Net(0)
    first_opt = make(first.parameters())
    with store_factory() as s:
        mgr = cnrstore.CheckpointManager(s, save_interval_steps=5, max_to_keep=2)
        for step in range(1, 13):
            _train(first, first_opt, [step])
            mgr.save(step, {"model": first, "optim": first_opt, "epoch": step // 5})
        mgr.wait()
        assert s.steps() == [5, 10]
    # A new process: a differently initialized model and a fresh optimizer (no state).
    model = Net(1)
    opt = make(model.parameters())
    assert not opt.state or optim == "adagrad"   # Adagrad makes its state at once
    with store_factory() as s:
        mgr = cnrstore.CheckpointManager(s, save_interval_steps=5, max_to_keep=2)
        step = mgr.latest_step()
        got = mgr.restore(into={"model": model, "optim": opt, "epoch": None})
        assert step == 10 and got["epoch"] == 2 and got["model"] is model
        _train(model, opt, range(step + 1, 21))
    _equal_runs(ref, ref_opt, model, opt)


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, optim):
    _resume_check(lambda: _open(tmp_path), optim)


def test_restore_into_a_model_already_trained_overwrites_it(tmp_path):
    model, opt = Net(0), torch.optim.Adam(Net(0).parameters())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, [1, 2])
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s)
        mgr.save(2, {"model": model, "optim": opt})
        _train(model, opt, [3])
        mgr.restore(into={"model": model, "optim": opt})
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k])
        assert int(opt.state_dict()["state"][0]["step"]) == 2


@pytest.fixture(params=["shared", "s3"])
def remote(request, tmp_path):
    """A factory of handles on one shared-directory or moto-S3 store, each with its own
    empty index cache (a restart on another host)."""
    if request.param == "shared":
        url, options = os.fspath(tmp_path / "shared"), {"gc_grace_s": 0.0}
    else:
        pytest.importorskip("obstore")
        server = request.getfixturevalue("moto_s3")
        url, options = server.url(), server.options
    caches = iter(range(100))
    return lambda: cnrstore.open(url, cache_dir=tmp_path / f"cache{next(caches)}",
                                 storage_options=options, block_rows=8)


def test_resume_on_shared_directory_and_s3_stores(remote):
    _resume_check(remote, "adam")


# -- many ranks --------------------------------------------------------------------------

def test_two_ranks_decide_alike_on_the_coordinators_clock(tmp_path):
    from manager_worker import train_and_save

    got = run(2, train_and_save, os.fspath(tmp_path / "dist"), timeout=120)
    assert got[0] == got[1], got
    # Every 4th step and every 10 s (3 s a step, rank 0's clock): 4 (both), 8, 12; 5 is
    # never saved (not due), so its loss of -1 is never seen.
    assert got[0]["saved"] == [4, 8, 12]
    assert got[0]["steps"] == got[0]["store_steps"]
    assert got[0]["same"] is True


def test_a_step_saved_before_the_first_optimizer_step_restores_a_stateless_optimizer(
        tmp_path):
    model = Net(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s)
        mgr.save(0, {"model": model, "optim": opt})
        fresh = Net(1)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
        mgr.restore(into={"model": fresh, "optim": fresh_opt})
        assert not fresh_opt.state and fresh_opt.param_groups[0]["lr"] == 0.01
        for a, b in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(a, b)
        # and it trains on as the original does
        _train(model, opt, [1, 2])
        _train(fresh, fresh_opt, [1, 2])
        _equal_runs(model, opt, fresh, fresh_opt)


def _same(a, b) -> bool:
    """Equal nestings of tensors (bit for bit) and Python values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
            a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _lbfgs_train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        ids, y = torch.randint(0, 50, (32,), generator=g), torch.randn(32, generator=g)

        def closure(ids=ids, y=y):
            opt.zero_grad()
            loss = (model(ids) - y).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)


def test_an_optimizer_whose_step_needs_a_closure_resumes_exactly(tmp_path):
    # LBFGS.step(closure) cannot be run with no closure, as a zero-learning-rate step to
    # make a fresh optimizer's state would; its state (a history of tensors, floats) is
    # made by its first step, so a restore must create it from the stored one.
    def make(ps):
        return torch.optim.LBFGS(ps, lr=0.5, max_iter=3, history_size=4)

    ref = Net(0)
    ref_opt = make(ref.parameters())
    _lbfgs_train(ref, ref_opt, range(1, 7))
    first = Net(0)
    first_opt = make(first.parameters())
    _lbfgs_train(first, first_opt, range(1, 4))
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s)
        mgr.save(3, {"model": first, "optim": first_opt})
        model = Net(1)
        opt = make(model.parameters())
        mgr.restore(into={"model": model, "optim": opt})
        assert _same(opt.state_dict(), first_opt.state_dict())
    _lbfgs_train(model, opt, range(4, 7))
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert _same(opt.state_dict(), ref_opt.state_dict())


def test_an_optimizer_that_needs_sparse_gradients_resumes_exactly(tmp_path):
    # SparseAdam refuses the dense zero gradients a zero-learning-rate step would give it.
    def step(emb, opt, ids):
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()

    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters())
    step(emb, opt, torch.arange(3))
    with _open(tmp_path) as s:
        mgr = cnrstore.CheckpointManager(s)
        mgr.save(1, {"model": emb, "optim": opt})
        fresh = torch.nn.Embedding(10, 4, sparse=True)
        fresh_opt = torch.optim.SparseAdam(fresh.parameters())
        mgr.restore(into={"model": fresh, "optim": fresh_opt})
        assert _same(fresh_opt.state_dict(), opt.state_dict())
    for model, o in ((emb, opt), (fresh, fresh_opt)):
        step(model, o, torch.tensor([2, 5, 7]))
    assert torch.equal(emb.weight, fresh.weight)
    assert _same(fresh_opt.state_dict(), opt.state_dict())


def test_a_background_write_failure_is_raised_by_the_next_call_and_not_recorded(tmp_path):
    with _open(tmp_path, lock_timeout=0.1) as s:
        mgr = cnrstore.CheckpointManager(s, max_to_keep=1)
        mgr.save(1, _state(1))
        mgr.wait()
        held = s.objects.writer()      # another writer holds the engine: step 2 times out
        try:
            assert mgr.save(2, _state(2))
            with pytest.raises(cnrstore.WriteFailed):
                mgr.save(3, _state(3))
        finally:
            held.abort()
        assert mgr.all_steps() == [1] == s.steps()   # and retention kept step 1
        assert mgr.save(3, _state(3))
        mgr.wait()
        assert s.steps() == [3]
        assert torch.equal(s.get_state(3)["w"], _state(3)["w"])


def test_retention_follows_steps_another_handle_deleted_and_foreign_metadata(tmp_path):
    with _open(tmp_path) as s:
        s.put_state(1, _state(), metadata={"metrics": "not a mapping"})
        mgr = cnrstore.CheckpointManager(s, max_to_keep=2, keep_best=1, best_metric="loss")
        for step in (2, 3, 4):
            mgr.save(step, _state(step), metrics={"loss": float(step)})
        mgr.wait()
        assert s.steps() == [2, 3, 4]
        with _open(tmp_path) as other:   # e.g. an operator's rollback
            other.rollback(2)
        mgr.save(5, _state(5), metrics={"loss": 9.0})
        mgr.save(6, _state(6), metrics={"loss": 8.0})
        mgr.wait()
        assert s.steps() == [2, 5, 6] == mgr.all_steps()

"""The demo's workload: it learns, it is deterministic, and its training state (model and a
torch.optim or row-wise optimizer) round-trips through put_state / load_state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cnrstore
import engine
from cnrstore.core.state import flatten
from cnrstore.demo.dlrm import (
    DLRM,
    DLRMConfig,
    RowWiseAdagrad,
    SyntheticCTR,
    Trainer,
    auc,
    deterministic,
    evaluate,
    make_optimizer,
    teacher_floor,
    train_step,
)

TINY = DLRMConfig(table_rows=(400, 200, 50), dim=8, batch_size=128, seed=3)
OPTIMIZERS = ["adagrad", "rowwise"]


def _fresh(config: DLRMConfig = TINY):
    model = DLRM(config)
    return model, make_optimizer(model, config)


def _tables(model, opt) -> dict[str, torch.Tensor]:
    return flatten({"model": model.state_dict(), "optim": opt.state_dict()}).tables


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_loss_falls_toward_the_teacher_floor(optimizer):
    data = SyntheticCTR(TINY)
    held_out = data.eval_batches(8)
    floor = teacher_floor(held_out)
    with deterministic():
        model, opt = _fresh(dataclasses.replace(TINY, optimizer=optimizer))
        start_loss, start_auc = evaluate(model, held_out)
        for step in range(400):
            train_step(model, opt, data.batch(step))
        end_loss, end_auc = evaluate(model, held_out)
    assert floor < 0.6, "the teacher's signal is too weak to learn anything"
    # The student closes at least half the gap to the floor and ranks far above chance.
    assert end_loss - floor < 0.5 * (start_loss - floor), (start_loss, end_loss, floor)
    assert end_auc > 0.7 and end_auc > start_auc + 0.1


def test_batches_are_a_pure_function_of_seed_and_step():
    a, b = SyntheticCTR(TINY), SyntheticCTR(TINY)
    for step in (0, 7, 7, 123):
        x, y = a.batch(step), b.batch(step)
        assert torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
        assert all(torch.equal(i, j) for i, j in zip(x.ids, y.ids))
    assert not torch.equal(a.batch(1).dense, a.batch(2).dense)
    other = SyntheticCTR(DLRMConfig(**{**TINY.__dict__, "seed": 4}))
    assert not torch.equal(other.batch(0).dense, a.batch(0).dense)
    # Held-out batches come from another stream than training batches.
    assert not torch.equal(a.eval_batches(1)[0].dense, a.batch(0).dense)


def test_ids_are_skewed_and_hot_rows_are_scattered():
    cfg = DLRMConfig(table_rows=(10_000,), batch_size=4096, seed=1)
    ids = SyntheticCTR(cfg).batch(0).ids[0].ravel()
    counts = torch.bincount(ids, minlength=10_000)
    top = torch.topk(counts, 20).indices
    # Zipf: the 20 hottest rows take a large share of all lookups...
    assert counts[top].sum() > 0.25 * len(ids)
    # ...and they are not packed at the start of the table.
    assert top.max() - top.min() > 2_000
    assert ids.min() >= 0 and ids.max() < 10_000


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_training_is_bit_reproducible(optimizer):
    config = dataclasses.replace(TINY, optimizer=optimizer)
    data = SyntheticCTR(config)
    runs = []
    for _ in range(2):
        with deterministic():
            model, opt = _fresh(config)
            for step in range(30):
                train_step(model, opt, data.batch(step))
        runs.append(_tables(model, opt))
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_restored_trainer_continues_bit_identically(optimizer):
    config = dataclasses.replace(TINY, optimizer=optimizer)
    store = cnrstore.CheckpointStore(engine.MemoryStore(), block_rows=64)
    with deterministic():
        trainer = Trainer(config, store=store, every=20)
        trainer.run(30)
        trainer.wait()
        expected = {k: v.clone() for k, v in trainer.tables().items()}
        resumed = Trainer(config, store=store, every=20)
        ptr = resumed.model.embs[0].weight.data_ptr()
        assert resumed.restore_latest() == 20
        assert resumed.model.embs[0].weight.data_ptr() == ptr  # restored in place
        resumed.run(30)
        got = resumed.tables()
    if optimizer == "adagrad":
        assert isinstance(resumed.opt, torch.optim.Adagrad)
        assert got["optim/state/0/sum"].shape == (400, 8)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_restoring_a_mismatched_checkpoint_writes_nothing():
    store = cnrstore.CheckpointStore(engine.MemoryStore())
    trainer = Trainer(TINY, store=store)
    trainer.checkpoint()
    trainer.wait()
    other = Trainer(dataclasses.replace(TINY, table_rows=(400, 200, 60)), store=store)
    before = {k: v.clone() for k, v in other.tables().items()}
    with pytest.raises(cnrstore.InvalidInput, match="embs.2"):
        other.restore_latest()
    for name, t in other.tables().items():
        assert torch.equal(t, before[name]), name


def test_row_wise_adagrad_touches_only_looked_up_rows():
    data = SyntheticCTR(TINY)
    model = DLRM(TINY)
    opt = RowWiseAdagrad(model, lr=TINY.lr, dense_lr=TINY.dense_lr)
    before = model.embs[0].weight.detach().clone()
    batch = data.batch(0)
    train_step(model, opt, batch)
    changed = (model.embs[0].weight.detach() != before).any(1).nonzero().ravel()
    assert set(changed.tolist()) <= set(batch.ids[0].ravel().tolist())
    assert len(changed) > 0
    acc = opt.emb_acc[0]
    assert set(acc.nonzero().ravel().tolist()) == set(batch.ids[0].ravel().unique().tolist())


def test_config_validation():
    with pytest.raises(ValueError):
        DLRMConfig(table_rows=())
    with pytest.raises(ValueError):
        DLRMConfig(dim=0)
    with pytest.raises(ValueError):
        TINY.scaled(0)
    with pytest.raises(ValueError, match="optimizer"):
        DLRMConfig(optimizer="sgd")
    assert TINY.scaled(2).table_rows == (800, 400, 100)


def _auc_by_pairs(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-5, 5), st.booleans()), min_size=2, max_size=60).filter(
        lambda xs: len({y for _, y in xs}) == 2
    )
)
def test_auc_matches_the_pairwise_definition(pairs):
    scores = np.array([float(s) for s, _ in pairs])  # small ints: many ties
    labels = np.array([int(y) for _, y in pairs])
    got = auc(torch.from_numpy(scores), torch.from_numpy(labels))
    assert got == pytest.approx(_auc_by_pairs(scores, labels), abs=1e-12)


def test_auc_edge_cases():
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0, 1])) == 1.0
    assert auc(torch.tensor([0.9, 0.1]), torch.tensor([0, 1])) == 0.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5
    with pytest.raises(ValueError, match="positive"):
        auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1]))


def test_trainer_refuses_cuda_without_it():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="CUDA"):
        Trainer(TINY, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_on_cuda_is_reproducible_and_learns():
    runs = []
    for _ in range(2):
        with deterministic():
            trainer = Trainer(TINY, device="cuda")
            trainer.run(200)
            runs.append({k: v.cpu() for k, v in trainer.tables().items()})
            loss, _ = evaluate(trainer.model, trainer.data.eval_batches(4))
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name
    assert loss < 0.65

"""The demo's workload: it learns, it is deterministic, and its state round-trips as tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.dlrm import (
    DLRM,
    DLRMConfig,
    RowWiseAdagrad,
    SyntheticCTR,
    Trainer,
    auc,
    deterministic,
    evaluate,
    load_state_tables,
    state_tables,
    teacher_floor,
    train_step,
)

TINY = DLRMConfig(table_rows=(400, 200, 50), dim=8, batch_size=128, seed=3)


def _fresh(config: DLRMConfig = TINY) -> tuple[DLRM, RowWiseAdagrad]:
    model = DLRM(config)
    return model, RowWiseAdagrad(model, lr=config.lr, dense_lr=config.dense_lr)


def test_loss_falls_toward_the_teacher_floor():
    data = SyntheticCTR(TINY)
    held_out = data.eval_batches(8)
    floor = teacher_floor(held_out)
    with deterministic():
        model, opt = _fresh()
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


def test_training_is_bit_reproducible():
    data = SyntheticCTR(TINY)
    runs = []
    for _ in range(2):
        with deterministic():
            model, opt = _fresh()
            for step in range(30):
                train_step(model, opt, data.batch(step))
        runs.append(state_tables(model, opt))
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def test_state_tables_cover_the_whole_training_state():
    data = SyntheticCTR(TINY)
    with deterministic():
        model, opt = _fresh()
        for step in range(20):
            train_step(model, opt, data.batch(step))
        saved = {k: v.clone() for k, v in state_tables(model, opt).items()}
        for step in range(20, 30):
            train_step(model, opt, data.batch(step))
        expected = {k: v.clone() for k, v in state_tables(model, opt).items()}
        # A fresh model + optimizer loaded from step 20 continues to the same state.
        model2, opt2 = _fresh(DLRMConfig(**{**TINY.__dict__, "seed": 99}))
        load_state_tables(model2, opt2, saved)
        for step in range(20, 30):
            train_step(model2, opt2, data.batch(step))
        got = state_tables(model2, opt2)
    assert saved["emb0.adagrad"].shape == (400,)
    assert all(t.ndim >= 1 for t in saved.values())
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_row_wise_adagrad_touches_only_looked_up_rows():
    data = SyntheticCTR(TINY)
    model, opt = _fresh()
    before = model.embs[0].weight.detach().clone()
    batch = data.batch(0)
    train_step(model, opt, batch)
    changed = (model.embs[0].weight.detach() != before).any(1).nonzero().ravel()
    assert set(changed.tolist()) <= set(batch.ids[0].ravel().tolist())
    assert len(changed) > 0
    acc = opt.emb_acc[0]
    assert set(acc.nonzero().ravel().tolist()) == set(batch.ids[0].ravel().unique().tolist())


def test_load_state_tables_refuses_a_mismatched_checkpoint():
    model, opt = _fresh()
    tables = {k: v.clone() for k, v in state_tables(model, opt).items()}
    with pytest.raises(ValueError, match="missing"):
        load_state_tables(model, opt, {k: v for k, v in tables.items() if k != "emb1"})
    with pytest.raises(ValueError, match="emb0"):
        load_state_tables(model, opt, {**tables, "emb0": torch.zeros(3, 8)})
    with torch.no_grad():
        model.embs[0].weight.zero_()
    load_state_tables(model, opt, tables)
    assert torch.equal(model.embs[0].weight.detach(), tables["emb0"])


def test_config_validation():
    with pytest.raises(ValueError):
        DLRMConfig(table_rows=())
    with pytest.raises(ValueError):
        DLRMConfig(dim=0)
    with pytest.raises(ValueError):
        TINY.scaled(0)
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

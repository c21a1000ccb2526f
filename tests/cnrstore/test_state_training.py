"""Model + optimizer round trips through put_state (issue 10): a job resumed from a
checkpoint continues bit-identically (exact tables) or closely (int8 embeddings), for
torch.optim's Adagrad, Adam and SGD with momentum."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import assert_identical, make_store
from torch import nn

OPTIMIZERS = {
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
}
CKPT, TOTAL = 4, 10


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embs = nn.ModuleList(nn.EmbeddingBag(300, 8, mode="sum") for _ in range(2))
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids):
        return self.mlp(sum(bag(i) for bag, i in zip(self.embs, ids))).squeeze(1)


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    ids = [torch.randint(0, 300, (32, 3), generator=g) for _ in range(2)]
    return ids, torch.randn(32, generator=g)


def _train(model, opt, steps) -> float:
    loss = torch.tensor(0.0)
    for step in steps:
        ids, y = _batch(step)
        loss = nn.functional.mse_loss(model(ids), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _job(kind: str, seed: int = 0):
    model = Net(seed)
    return model, OPTIMIZERS[kind](model.parameters())


def _state(model, opt, epoch):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": epoch,
            "rng": torch.get_rng_state()}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("how", ["get_state", "load_state", "guide"])
def test_exact_resume_continues_bit_identically(tmp_path, kind, how):
    """``guide``: docs/GUIDE.md's resume pattern with a fresh optimizer, whose state Adam
    and SGD create only at the first step (issue 23: it resumed with none, silently)."""
    store = make_store("pack", tmp_path / "s", block_rows=64)
    model, opt = _job(kind)
    _train(model, opt, range(CKPT))
    store.put_state(CKPT, _state(model, opt, 1), blocking=False).result()
    ref_loss = _train(model, opt, range(CKPT, TOTAL))
    store.close()

    store = make_store("pack", tmp_path / "s", block_rows=64)
    fresh, fopt = _job(kind, seed=1)
    if how == "get_state":
        st = store.get_state()
        fresh.load_state_dict(st["model"])
        fopt.load_state_dict(st["optim"])
    elif how == "guide":
        st = store.load_state(None, _state(fresh, fopt, 0))
        fopt.load_state_dict(st["optim"])
        assert len(fopt.state_dict()["state"]) == len(opt.state_dict()["state"])
    else:
        _train(fresh, fopt, range(50, 52))  # the optimizer has state to restore into
        ptrs = [p.data_ptr() for p in fresh.parameters()]
        st = store.load_state(CKPT, _state(fresh, fopt, 0))
        assert [p.data_ptr() for p in fresh.parameters()] == ptrs  # in place
        fopt.load_state_dict(st["optim"])  # the Python values (lr, betas, ...) of the step
    assert st["epoch"] == 1
    torch.set_rng_state(st["rng"])
    assert _train(fresh, fopt, range(CKPT, TOTAL)) == ref_loss
    for p, q in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert_identical(q, p)
    # The next put after a restore is incremental: only touched rows are written.
    info = store.put_state(TOTAL, _state(fresh, fopt, 2))
    assert info.rows_changed["model/embs.0.weight"] < 300
    store.close()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_int8_embeddings_resume_closely_with_exact_optimizer_state(kind):
    store = make_store("memory", None, block_rows=64)
    model, opt = _job(kind)
    _train(model, opt, range(CKPT))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    store.put_state(CKPT, _state(model, opt, 1), quant={"model/embs.*.weight": "int8"})
    ref_loss = _train(model, opt, range(CKPT, TOTAL))

    fresh, fopt = _job(kind, seed=1)
    st = store.get_state()
    for name, t in st["model"].items():
        if name.startswith("embs."):
            assert torch.allclose(t, saved[name], atol=0.03) and not torch.equal(t, saved[name])
        else:
            assert_identical(t, saved[name])  # dense layers stay exact
    fresh.load_state_dict(st["model"])
    fopt.load_state_dict(st["optim"])
    for a, b in zip(opt.state_dict()["param_groups"], fopt.state_dict()["param_groups"]):
        assert a == b
    loss = _train(fresh, fopt, range(CKPT, TOTAL))
    assert abs(loss - ref_loss) < 0.05 * abs(ref_loss) + 1e-3

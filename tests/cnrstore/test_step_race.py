"""Two writers putting the same step: exactly one wins, the other gets StepExists, and the
stored step is the winner's, whole (issue 8, item 1). The existence check of ``put`` runs
before the writer lock, so only the engine's create-only root, re-checked at commit, can
settle the race."""

from __future__ import annotations

import pytest
import torch
from rankserver import context

import cnrstore
from cnrstore.errors import StepExists

TRIALS = 10


def _tables(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(64, 8, generator=g), "extra": torch.randn(7, generator=g)}


def _racer(path: str, seed: int, barrier, out) -> None:
    store = cnrstore.open(path, lock_timeout=30.0, seed_from_store=False)
    try:
        barrier.wait(timeout=60)
        store.put_tables(1, _tables(seed))
        out.put((seed, "won"))
    except StepExists:
        out.put((seed, "lost"))
    except BaseException as exc:  # noqa: BLE001 - report anything else to the parent
        out.put((seed, f"error {type(exc).__name__}: {exc}"))
    finally:
        store.close()


# Two trials in the default suite; the rest, for more interleavings, under -m slow.
@pytest.mark.parametrize("trial", [t if t < 2 else pytest.param(t, marks=pytest.mark.slow)
                                   for t in range(TRIALS)])
def test_two_processes_putting_one_step_exactly_one_wins(tmp_path, trial):
    path = str(tmp_path / "ckpt")
    cnrstore.open(path).close()
    ctx = context()
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(path, seed, barrier, out))
             for seed in (100 + trial, 200 + trial)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(results.values()) == ["lost", "won"], results
    winner = next(seed for seed, r in results.items() if r == "won")
    with cnrstore.open(path) as store:
        assert store.steps() == [1]
        got = store.get_tables(1)
        for name, t in _tables(winner).items():
            assert torch.equal(got[name], t), name
        assert store.verify().ok


def test_two_handles_in_one_process_the_second_put_fails(tmp_path):
    path = tmp_path / "ckpt"
    a = cnrstore.open(path, seed_from_store=False)
    b = cnrstore.open(path, seed_from_store=False)
    try:
        # b's early check sees no step 1 yet; a commits between that check and b's commit.
        fa = a.put_tables(1, _tables(1), blocking=False)
        fb = b.put_tables(1, _tables(2), blocking=False)
        outcomes = []
        for f in (fa, fb):
            try:
                f.result()
                outcomes.append("won")
            except StepExists:
                outcomes.append("lost")
        assert sorted(outcomes) == ["lost", "won"]
        seed = 1 if outcomes[0] == "won" else 2
        got = b.get_tables(1)
        for name, t in _tables(seed).items():
            assert torch.equal(got[name], t)
        # The loser's handle stays usable.
        loser = b if outcomes[1] == "lost" else a
        loser.put_tables(2, _tables(3))
        assert loser.steps() == [1, 2]
    finally:
        a.close()
        b.close()


def test_engine_create_root_refuses_an_existing_name_at_commit(tmp_path):
    import engine

    for store in (engine.MemoryStore(), engine.open(tmp_path / "s")):
        with store:
            with store.writer() as w:
                oid = w.put(1, b"first")
                w.create_root("step", oid)
            w = store.writer()
            other = w.put(1, b"second")
            with pytest.raises(engine.RootExists) as info:
                w.create_root("step", other)
            assert info.value.name == "step"
            w.abort()
            assert store.root("step") == oid
            assert not store.has(other)

"""A Hypothesis state machine drives put / get / delete_step / gc / reopen on a real pack
store and checks it against a dict of the expected tables of every kept step."""

from __future__ import annotations

import shutil
import tempfile

import torch
from ckpt_util import assert_identical, random_table
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cnrstore

NAMES = ("a", "b", "c")
SCHEME = {"a": "exact", "b": "exact", "c": "fp16"}
TAIL = {"a": (4,), "b": (), "c": (3,)}
DTYPE = {"a": torch.float32, "b": torch.int32, "c": torch.float32}
OPTS = {"block_rows": 4, "fanout": 2, "max_chain": 2}


def _expected(name: str, t: torch.Tensor) -> torch.Tensor:
    """What a get must return, computed by torch itself, not by the code under test."""
    if SCHEME[name] == "exact":
        return t.clone()
    assert SCHEME[name] == "fp16"
    return t.half().to(t.dtype)


class CheckpointMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="cnr-sm-")
        self.store = self.open_store(seed=False)
        self.model: dict[int, dict[str, torch.Tensor]] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.current = {n: random_table(self.gen, 6, *TAIL[n], dtype=DTYPE[n]) for n in NAMES}

    def teardown(self):
        try:
            if not self.store._core.closed:
                assert self.store.verify().ok
                self.store.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        step=st.integers(0, 7),
        names=st.sets(st.sampled_from(NAMES)),
        change=st.sampled_from(["none", "rows", "grow", "shrink"]),
        blocking=st.booleans(),
    )
    def put(self, step, names, change, blocking):
        for n in names:
            t = self.current[n]
            if change == "rows" and t.shape[0]:
                idx = torch.randint(0, t.shape[0], (2,), generator=self.gen)
                t[idx] = random_table(self.gen, 2, *TAIL[n], dtype=DTYPE[n])
            elif change == "grow":
                extra = random_table(self.gen, 5, *TAIL[n], dtype=DTYPE[n])
                self.current[n] = torch.cat([t, extra])
            elif change == "shrink":
                self.current[n] = t[: t.shape[0] // 2].clone()
        tables = {n: self.current[n] for n in sorted(names)}
        quant = {n: SCHEME[n] for n in tables}
        if step in self.model:
            try:
                self.store.put_tables(step, tables, quant=quant, blocking=blocking)
            except cnrstore.StepExists:
                return
            raise AssertionError(f"put of existing step {step} was accepted")
        if self.model and step < max(self.model):
            try:
                self.store.put_tables(step, tables, quant=quant, blocking=blocking)
            except cnrstore.StepOrderError:
                return
            raise AssertionError(f"put of step {step} below {max(self.model)} was accepted")
        result = self.store.put_tables(step, tables, quant=quant, blocking=blocking)
        self.model[step] = {n: _expected(n, t) for n, t in tables.items()}
        if blocking:
            assert result.step == step

    @rule(step=st.integers(0, 7), partial=st.booleans())
    def get(self, step, partial):
        if step not in self.model:
            try:
                self.store.get_tables(step)
            except cnrstore.StepNotFound:
                return
            raise AssertionError(f"get of missing step {step} succeeded")
        want = self.model[step]
        if partial and want:
            name = sorted(want)[0]
            got = self.store.get_tables(step, names=[name], rows={name: slice(1, None, 2)})
            assert list(got) == [name]
            assert_identical(got[name], want[name][1::2])
            return
        got = self.store.get_tables(step)
        assert sorted(got) == sorted(want)
        for n, t in want.items():
            assert_identical(got[n], t)

    @precondition(lambda self: self.model)
    @rule()
    def get_latest(self):
        got = self.store.get_tables()
        want = self.model[max(self.model)]
        assert sorted(got) == sorted(want)

    @rule(step=st.integers(0, 7))
    def rollback(self, step):
        if step not in self.model:
            try:
                self.store.rollback(step)
            except cnrstore.StepNotFound:
                return
            raise AssertionError(f"rollback to missing step {step} succeeded")
        later = sorted(s for s in self.model if s > step)
        assert self.store.rollback(step) == later
        self.model = {s: v for s, v in self.model.items() if s <= step}

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def get_into(self, data):
        step = data.draw(st.sampled_from(sorted(self.model)))
        want = self.model[step]
        out = {n: torch.empty_like(t) for n, t in want.items()}
        ptrs = {n: t.data_ptr() for n, t in out.items()}
        got = self.store.get_tables(step, out=out)
        for n, t in want.items():
            assert got[n] is out[n] and got[n].data_ptr() == ptrs[n]
            assert_identical(got[n], t)

    @rule(step=st.integers(0, 7))
    def delete(self, step):
        if step in self.model:
            self.store.delete_step(step)
            del self.model[step]
        else:
            try:
                self.store.delete_step(step)
            except cnrstore.StepNotFound:
                return
            raise AssertionError(f"delete of missing step {step} succeeded")

    @rule(keep_last=st.none() | st.integers(0, 3), keep=st.sets(st.integers(0, 7), max_size=2))
    def gc(self, keep_last, keep):
        steps = sorted(self.model)
        if keep_last == 0 or not keep <= set(steps):
            # A rule that would drop steps by mistake is refused (issue 8): nothing dropped.
            try:
                self.store.gc(keep_last=keep_last, keep=keep)
            except cnrstore.InvalidInput:
                return
            raise AssertionError(f"gc(keep_last={keep_last}, keep={keep}) was accepted")
        if keep_last is None and not keep:
            kept = set(steps)
        else:
            newest = sorted(steps, reverse=True)[:keep_last] if keep_last else []
            kept = set(newest) | (keep & set(steps))
        report = self.store.gc(keep_last=keep_last, keep=keep)
        assert set(report.steps_kept) == kept
        assert set(report.steps_deleted) == set(steps) - kept
        self.model = {s: v for s, v in self.model.items() if s in kept}

    @rule(seed=st.booleans())
    def reopen(self, seed):
        self.store.close()
        self.store = self.open_store(seed=seed)

    def open_store(self, *, seed: bool) -> cnrstore.CheckpointStore:
        """Open (again) the store under test; test_state_machine_s3.py opens a bucket."""
        return cnrstore.open(self.dir, seed_from_store=seed, **OPTS)

    @invariant()
    def steps_match(self):
        assert self.store.steps() == sorted(self.model)


CheckpointMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None
)
test_checkpoint_state_machine = CheckpointMachine.TestCase

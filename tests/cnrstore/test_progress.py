"""``progress=`` on the Python API's long calls (cnrstore/core/progress.py): put, get,
load_state, gc and verify report monotone (done, total) ending with one done == total when
their work is at least ``progress_min_bytes``, and nothing under it; the CLI's bar
(cnrstore.tools.progress.Progress) is such a callback."""

from __future__ import annotations

import io

import pytest
import torch

import cnrstore
from cnrstore.tools.progress import Progress


class Calls(list):
    def __call__(self, done: int, total: int) -> None:
        self.append((done, total))

    def check(self) -> int:
        """Monotone, one total, exactly one final call and it is the last; its total."""
        assert self, "no progress was reported"
        totals = {t for _, t in self}
        assert len(totals) == 1, self
        total = totals.pop()
        dones = [d for d, _ in self]
        assert dones == sorted(dones) and dones[0] >= 0, self
        assert dones[-1] == total and dones.count(total) == 1, self
        return total


def _tables() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(256, 32, generator=g), "b": torch.randn(128, 16, generator=g)}


NBYTES = 256 * 32 * 4 + 128 * 16 * 4


@pytest.fixture
def store(tmp_path):
    with cnrstore.open(tmp_path / "ckpt", block_rows=16, progress_min_bytes=1024) as s:
        yield s


def test_put_reports_bytes_and_ends_when_committed(store):
    calls = Calls()
    store.put_tables(1, _tables(), progress=calls)
    assert calls.check() == NBYTES and len(calls) >= 2
    calls = Calls()
    fut = store.put_state(2, {"m": _tables()}, blocking=False, progress=calls)
    fut.result()
    store.steps()
    assert calls.check() == NBYTES


def test_get_and_load_report_per_block(store):
    store.put_tables(1, _tables())
    for call in (lambda p: store.get_tables(1, progress=p),
                 lambda p: store.get_state(progress=p),
                 lambda p: store.get_tables(out={k: torch.empty_like(v)
                                                 for k, v in _tables().items()}, progress=p),
                 lambda p: store.load_state(1, _tables(), progress=p)):
        calls = Calls()
        call(calls)
        assert calls.check() == NBYTES
        assert len(calls) > 16, call.__code__.co_firstlineno  # 24 blocks: a call each
    calls = Calls()
    got = store.get_tables(1, rows={"a": slice(10, 50)}, names=["a"], progress=calls)
    assert calls.check() == got["a"].nbytes == 40 * 32 * 4


def test_gc_and_verify_report_thousandths(store):
    for step in range(1, 5):
        store.put_tables(step, {k: v + step for k, v in _tables().items()})
    for call in (lambda p: store.verify(progress=p), lambda p: store.verify(deep=False,
                                                                           progress=p),
                 lambda p: store.gc(keep_last=1, progress=p)):
        calls = Calls()
        call(calls)
        assert calls.check() == 1000 and len(calls) >= 2


def test_nothing_is_reported_under_the_threshold(tmp_path):
    with cnrstore.open(tmp_path / "c", block_rows=16, progress_min_bytes=NBYTES + 1) as s:
        calls = Calls()
        s.put_tables(1, _tables(), progress=calls)
        s.get_tables(1, progress=calls)
        s.load_state(1, _tables(), progress=calls)
        assert calls == []
    with cnrstore.open(tmp_path / "c", progress_min_bytes=1 << 40) as s:
        s.verify(progress=calls)
        s.gc(keep_last=1, progress=calls)
        assert calls == []


def test_a_bad_progress_is_refused_before_anything_is_written(store):
    with pytest.raises(cnrstore.InvalidType):
        store.put_tables(1, _tables(), progress="yes")
    assert store.steps() == []
    with pytest.raises(cnrstore.InvalidType):
        store.get_tables(progress=1)


def test_the_clis_bar_draws_an_api_call(store):
    out = io.StringIO()
    with Progress("put", enabled=True, stream=out) as bar:
        store.put_tables(1, _tables(), progress=bar)
    assert f"100.0% {NBYTES}/{NBYTES}" in out.getvalue()


def test_a_put_that_fails_never_reports_its_end(tmp_path):
    with cnrstore.open(tmp_path / "c", block_rows=16, progress_min_bytes=1024,
                       lock_timeout=0.1) as s:
        held = s.objects.writer()
        calls = Calls()
        try:
            fut = s.put_tables(1, _tables(), blocking=False, progress=calls)
            with pytest.raises(cnrstore.WriteFailed):
                fut.result(timeout=60)
        finally:
            held.abort()
        assert calls and all(d < NBYTES for d, _ in calls)
        assert s.steps() == []

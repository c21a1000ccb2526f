"""A non-blocking intN put copies the changed rows on the caller's thread and encodes them on
the writer (cnrstore/core/hostcodes.py, issue 27's stall): it must store exactly what a
blocking put stores, refuse bad rows before it returns, and hold the values at call time."""

from __future__ import annotations

import threading

import pytest
import torch
from ckpt_util import make_store

import cnrstore
from cnrstore.core import hostcodes


def _steps(dtype, seed):
    """A full put's table and the row updates of 4 steps (some to huge values: wide)."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(300, 12, generator=g) * 0.1).to(dtype)
    updates = []
    for step in range(4):
        rows = torch.randperm(300, generator=g)[: 10 + 20 * step]
        updates.append((rows, (torch.randn(len(rows), 12, generator=g) * 0.1).to(dtype)))
    return t, updates


@pytest.mark.parametrize("scheme", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_blocking_puts_store_what_blocking_puts_store(tmp_path, scheme, dtype):
    seen: list[str] = []
    real = hostcodes.encode_rows

    def spy(rows, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(rows, *args, **kwargs)

    ids = {}
    for blocking in (True, False):
        t, updates = _steps(dtype, seed=3)
        s = make_store("pack", tmp_path / f"s{blocking}", block_rows=32, fanout=4)
        hostcodes.encode_rows = spy
        try:
            s.put_tables(0, {"t": t}, quant=scheme)
            seen.clear()
            got = []
            for step, (rows, vals) in enumerate(updates, start=1):
                t[rows] = vals
                out = s.put_tables(step, {"t": t}, quant=scheme, blocking=blocking)
                info = out if blocking else out.result(timeout=60)
                got.append(info.tables["t"])
        finally:
            hostcodes.encode_rows = real
        ids[blocking] = got
        threads = set(seen)
        if blocking:
            assert threads == {threading.current_thread().name}
        else:  # the incremental encodes ran on the writer thread
            assert threads == {"cnrstore-writer"}
        s.close()
    # Content-addressed table nodes: the same ids are the same stored bytes.
    assert ids[True] == ids[False]


def test_a_non_blocking_put_refuses_nan_in_changed_rows_before_returning(tmp_path):
    s = make_store("pack", tmp_path / "s", block_rows=32)
    t = torch.randn(200, 8)
    s.put_tables(0, {"t": t}, quant="int8")
    t[17, 3] = float("nan")
    t[150, 0] = float("inf")
    with pytest.raises(cnrstore.NonFiniteValues, match="17"):
        s.put_tables(1, {"t": t}, quant="int8", blocking=False)
    assert s.steps() == [0]
    t[17, 3], t[150, 0] = 0.0, 0.0
    s.put_tables(1, {"t": t}, quant="int8", blocking=False).result(timeout=60)
    assert s.steps() == [0, 1]
    s.close()


def test_a_changed_row_that_needs_wide_qparams_is_encoded_as_a_blocking_put_would(tmp_path):
    ids = []
    for blocking in (True, False):
        s = make_store("pack", tmp_path / f"w{blocking}", block_rows=32)
        t = torch.randn(200, 8, generator=torch.Generator().manual_seed(5))
        s.put_tables(0, {"t": t}, quant="int8")
        t[40] = 1e6  # beyond fp16 qparams: the whole table goes wide
        out = s.put_tables(1, {"t": t}, quant="int8", blocking=blocking)
        ids.append((out if blocking else out.result(timeout=60)).tables["t"])
        assert torch.allclose(s.get_tables(1)["t"][40], torch.full((8,), 1e6))
        s.close()
    assert ids[0] == ids[1]


def test_rows_changed_right_after_a_non_blocking_put_are_stored_as_they_were(tmp_path):
    s = make_store("pack", tmp_path / "s", block_rows=32, max_inflight=4)
    t = torch.randn(200, 8)
    s.put_tables(0, {"t": t}, quant="int8")
    want, futs = [], []
    for step in range(1, 5):
        t[step * 7] += 1.0
        want.append(t.clone())
        futs.append(s.put_tables(step, {"t": t}, quant="int8", blocking=False))
        t[step * 7] = 99.0  # at once, while the writer may still be encoding
    for f in futs:
        f.result(timeout=60)
    for step, w in enumerate(want, start=1):
        assert torch.allclose(s.get_tables(step)["t"], w, atol=0.02)
    s.close()


def _touched_steps(seed, steps=12):
    """A table and per step its updated rows plus rows looked up but not changed (as a
    tracker reports them), enough steps at max_chain=2 for blocks written whole or merged
    (rows the step did not touch among the rows written)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(300, 12, generator=g) * 0.1
    out = []
    for _ in range(steps):
        perm = torch.randperm(300, generator=g)
        rows, looked = perm[:25], perm[25:40]
        out.append((rows, torch.randn(len(rows), 12, generator=g) * 0.1,
                    torch.cat([rows, looked, rows[:3]])))  # unsorted, with repeats
    return t, out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("layout", ["chains", "grouped"])
def test_touched_non_blocking_puts_store_what_blocking_puts_store(tmp_path, scheme, layout):
    """Tracker-driven non-blocking puts (touched rows hashed, changed rows copied in the
    stall, encoded on the writer): the same table nodes as blocking puts without touched=,
    over steps that write blocks whole, merge chains and (grouped) clean objects."""
    ids = {}
    for mode in ("blocking", "touched"):
        t, steps = _touched_steps(seed=11)
        s = make_store("pack", tmp_path / mode, block_rows=32, fanout=4, max_chain=2,
                       layout=layout)
        s.put_tables(0, {"t": t}, quant=scheme)
        got = []
        for step, (rows, vals, looked) in enumerate(steps, start=1):
            t[rows] = vals
            if mode == "blocking":
                info = s.put_tables(step, {"t": t}, quant=scheme)
            else:
                info = s.put_tables(step, {"t": t}, quant=scheme, blocking=False,
                                    touched={"t": looked}).result(timeout=60)
            got.append(info.tables["t"])
        ids[mode] = got
        s.close()
    assert ids["blocking"] == ids["touched"]


def test_a_touched_non_blocking_put_refuses_nan_and_goes_wide_as_a_blocking_put(tmp_path):
    s = make_store("pack", tmp_path / "s", block_rows=32)
    t = torch.randn(200, 8)
    s.put_tables(0, {"t": t}, quant="int8")
    t[17, 3] = float("nan")
    t[150, 0] = 1.0
    with pytest.raises(cnrstore.NonFiniteValues, match="17"):
        s.put_tables(1, {"t": t}, quant="int8", blocking=False,
                     touched={"t": torch.tensor([150, 17, 3])})
    assert s.steps() == [0]
    t[17, 3] = 0.0
    t[199] = 1e6  # beyond fp16 qparams: encoded now, the table wide, as a blocking put
    out = s.put_tables(1, {"t": t}, quant="int8", blocking=False,
                       touched={"t": torch.tensor([17, 150, 199])}).result(timeout=60)
    assert out.rows_changed == {"t": 200}  # the whole table written again, wide
    back = s.get_tables(1)["t"]
    assert torch.allclose(back[199], torch.full((8,), 1e6))
    assert torch.allclose(back, t, atol=0.02)
    s.close()


def test_rows_changed_right_after_a_touched_non_blocking_put_are_stored_as_they_were(
        tmp_path):
    s = make_store("pack", tmp_path / "s", block_rows=32, max_inflight=4)
    t = torch.randn(200, 8)
    s.put_tables(0, {"t": t}, quant="int8")
    want, futs = [], []
    for step in range(1, 6):
        rows = torch.tensor([step * 7, step * 7 + 1, 150])
        t[rows] += 1.0
        want.append(t.clone())
        futs.append(s.put_tables(step, {"t": t}, quant="int8", blocking=False,
                                 touched={"t": rows}))
        t[rows] = 99.0  # at once, while the writer may still be encoding
        t.copy_(want[-1])  # the next step starts from the stored values
    for f in futs:
        f.result(timeout=60)
    for step, w in enumerate(want, start=1):
        assert torch.allclose(s.get_tables(step)["t"], w, atol=0.02)
    s.close()

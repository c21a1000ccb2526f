"""Round trips over several steps: every kept step restores bit-identically under "exact",
and under a lossy scheme exactly as the codec itself would decode the rows put."""

from __future__ import annotations

import math

import pytest
import torch
from ckpt_util import FLOAT_DTYPES, INT_DTYPES, assert_identical, make_store, random_table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cnrstore.codec.quantize import SCHEMES, decode_rows, encode_rows

ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
SPECIALS = (float("nan"), float("inf"), float("-inf"), -0.0, 0.0)


def _codec_view(t: torch.Tensor, scheme: str) -> torch.Tensor:
    """What a lossy scheme must give back: the codec's own decode of the put rows."""
    if scheme == "exact" or t.shape[0] == 0 or math.prod(t.shape[1:]) == 0:
        return t
    flat = t.reshape(t.shape[0], -1)
    out = decode_rows(encode_rows(flat, scheme), scheme, t.dtype, flat.shape[1])
    return out.reshape(t.shape)


def _with_specials(g: torch.Generator, t: torch.Tensor) -> torch.Tensor:
    if not t.dtype.is_floating_point or t.numel() == 0:
        return t
    flat = t.reshape(-1)
    picks = torch.randint(0, flat.numel(), (min(4, flat.numel()),), generator=g)
    for k, p in enumerate(picks.tolist()):
        flat[p] = SPECIALS[k % len(SPECIALS)]
    if t.dtype == torch.float32:  # a NaN with a payload must survive bit for bit
        flat.view(torch.int32)[picks[0]] = 0x7FC0_1234
    return t


@st.composite
def scenarios(draw):
    dtype = draw(st.sampled_from(ALL_DTYPES))
    tail = draw(st.sampled_from([(), (1,), (3,), (0,), (2, 3), (5,)]))
    # 1-D tables are always stored exactly (quantspec.py), so lossy needs ndim >= 2.
    lossy = dtype in FLOAT_DTYPES and tail != () and draw(st.booleans())
    scheme = draw(st.sampled_from(SCHEMES[1:])) if lossy else "exact"
    block_rows = draw(st.sampled_from([1, 2, 3, 5, 8]))
    near = [0, 1, block_rows - 1, block_rows, block_rows + 1, 3 * block_rows + 2]
    rows = [draw(st.sampled_from(near) | st.integers(0, 30)) for _ in range(4)]
    seed = draw(st.integers(0, 2**31 - 1))
    frac = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    use_touched = draw(st.booleans())
    return dtype, scheme, block_rows, tail, rows, seed, frac, use_touched


def _evolve(g, t: torch.Tensor, rows: int, frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Next version: random rows rewritten, then grown or shrunk to ``rows``; also the ids
    of the rewritten rows that remain (what a caller tracking touched rows would pass)."""
    t = t.clone()
    n = t.shape[0]
    idx = torch.zeros(0, dtype=torch.int64)
    if n and frac:
        idx = torch.randperm(n, generator=g)[: max(1, int(n * frac))]
        t[idx] = random_table(g, len(idx), *t.shape[1:], dtype=t.dtype)
    if rows > n:
        t = torch.cat([t, random_table(g, rows - n, *t.shape[1:], dtype=t.dtype)])
    return t[:rows].clone(), idx[idx < rows]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_step_restores(scenario):
    dtype, scheme, block_rows, tail, rows, seed, frac, use_touched = scenario
    g = torch.Generator().manual_seed(seed)
    s = make_store("memory", None, block_rows=block_rows, fanout=2, max_chain=2)
    t = random_table(g, rows[0], *tail, dtype=dtype)
    if scheme == "exact":
        t = _with_specials(g, t)
    want = {}
    for step, n in enumerate(rows):
        if step:
            t, idx = _evolve(g, t, n, frac)
        touched = {"t": idx} if step and use_touched else None
        tables = {"t": t, "ctl": torch.arange(step + 1)}
        s.put_tables(step, tables, quant={"t": scheme}, touched=touched)
        want[step] = _codec_view(t, scheme)
    for step, expected in want.items():
        got = s.get_tables(step)
        assert_identical(got["t"], expected)
        assert_identical(got["ctl"], torch.arange(step + 1))
        if expected.shape[0]:
            lo = expected.shape[0] // 3
            part = s.get_tables(step, names=["t"], rows={"t": slice(lo, None, 2)})["t"]
            assert_identical(part, expected[lo::2])
    assert s.verify().ok


def test_pack_store_roundtrip_of_all_dtypes_and_schemes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tables, quant = {}, {}
    for dtype in ALL_DTYPES:
        name = str(dtype).removeprefix("torch.")
        tables[name] = _with_specials(g, random_table(g, 50, 3, dtype=dtype))
    for scheme in SCHEMES[1:]:
        tables[scheme] = random_table(g, 70, 9)
        quant[scheme] = scheme
    with make_store("pack", tmp_path / "s", block_rows=16) as s:
        s.put_tables(1, tables, quant=quant)
        for name in tables:
            tables[name][7] = tables[name][8]
        s.put_tables(2, tables, quant=quant)
    with make_store("pack", tmp_path / "s", block_rows=16) as s:
        got = s.get_tables(2)
        for name, t in tables.items():
            assert_identical(got[name], _codec_view(t, quant.get(name, "exact")))
        assert s.verify().ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tables_diff_on_device_and_restore_to_cuda():
    g = torch.Generator().manual_seed(1)
    s = make_store("memory", None, block_rows=64)
    t = {"f": random_table(g, 1000, 16).cuda(), "q": random_table(g, 300, 8).cuda()}
    quant = {"q": "int8"}
    s.put_tables(1, t, quant=quant)
    t["f"][[3, 700]] += 1.0
    t["q"][10] -= 1.0
    fut = s.put_tables(2, t, quant=quant, blocking=False)
    t["f"].zero_()  # right after the put returned: must not reach the store
    info = fut.result()
    assert info.rows_changed == {"f": 2, "q": 1}
    got = s.get_tables(2, device="cuda")
    assert got["f"].is_cuda and got["q"].is_cuda
    cpu = s.get_tables(2)
    assert torch.equal(got["f"].cpu(), cpu["f"]) and float(cpu["f"].abs().sum()) > 0
    assert_identical(cpu["q"], _codec_view(t["q"], "int8").cpu())  # codes made on the GPU
    t["f"][5] += 1.0
    assert s.put_tables(3, t, touched={"f": [5]}, quant=quant).rows_changed["f"] == 1

"""The column join's pure parts, in one process: the even split of whole rows a put
gives each rank, and whole tables assembled from column pieces (tiling checked, the
error naming the table and its pieces)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.distributed.columns import target_rows, whole
from cnrstore.errors import InvalidInput


@given(rows=st.integers(0, 200), world=st.integers(1, 9))
def test_the_even_split_tiles_the_rows(rows, world):
    spans = [target_rows(rows, world, r) for r in range(world)]
    assert spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert max(h - lo for lo, h in spans) - min(h - lo for lo, h in spans) <= 1


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rows=st.integers(1, 30), cols=st.integers(1, 12))
def test_pieces_of_any_grid_assemble_the_table(data, rows, cols):
    t = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    rcut = sorted(set(data.draw(st.lists(st.integers(1, rows), max_size=3))) | {rows})
    ccut = sorted(set(data.draw(st.lists(st.integers(1, cols), max_size=3))) | {cols})
    pcs = []
    for r0, r1 in zip([0, *rcut], rcut):
        for c0, c1 in zip([0, *ccut], ccut):
            if r1 > r0 and c1 > c0:
                pcs.append((t[r0:r1, c0:c1].clone(), r0, c0))
    order = data.draw(st.permutations(pcs))
    assert torch.equal(whole("emb", rows, cols, list(order)), t)


def test_pieces_that_do_not_tile_name_the_table_and_pieces():
    gap = [(torch.zeros(4, 2), 0, 0), (torch.zeros(4, 1), 0, 3)]
    with pytest.raises(InvalidInput, match=r"'emb'.*rows 0\.\.4.*cols 3\.\.4"):
        whole("emb", 4, 4, gap)
    twice = [(torch.zeros(4, 2), 0, 0), (torch.zeros(4, 2), 0, 0), (torch.zeros(4, 2), 0, 2)]
    with pytest.raises(InvalidInput, match="exactly one"):
        whole("emb", 4, 4, twice)


def test_received_rows_of_tables_of_several_dtypes_assemble():
    # one rank's bytes hold a float16 table's rows, then a float32 table's: the second
    # starts 2 bytes in, where a float32 view of the buffer itself cannot start
    from cnrstore.distributed.columns import Joined

    a = torch.tensor([[1.5]], dtype=torch.float16)
    b = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    raw = torch.cat([a.reshape(-1).view(torch.uint8), b[:, :1].contiguous().reshape(-1).view(
        torch.uint8), b[:, 1:].contiguous().reshape(-1).view(torch.uint8)])
    specs = {"a": (1, 1, "float16", [(0, 0, 1, 0, 1)]),
             "b": (3, 2, "float32", [(0, 0, 3, 0, 1), (0, 0, 3, 1, 1)])}
    got = Joined(0, 1, specs, list(torch.split(raw, [raw.numel()])), None).shards()
    assert torch.equal(got["a"].local, a) and torch.equal(got["b"].local, b)

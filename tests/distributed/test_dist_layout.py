"""The tiling check and block ownership (cnrstore/distributed/layout.py), in one process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore import InvalidInput, Shard
from cnrstore.codec.layout import dtype_name
from cnrstore.distributed import layout


def _specs(*ranks):
    return [{n: t.spec() for n, t in layout.local_tables(r).items()} for r in ranks]


def test_rows_sent_to_another_rank_carry_only_themselves():
    # Regression: the boundary rows were views of the shard, and pickling a view sends its
    # whole storage: every put all-gathered every rank's whole shards (found by the bench).
    # Now the rows go in a send buffer that holds just them.
    big = torch.randn(100_000, 16)
    mine = {"t": Shard(big[5:], row_offset=5, rows=100_000)}
    other = {"t": Shard(torch.randn(5, 16), row_offset=0, rows=100_000)}
    gt = layout.global_tables(_specs(other, mine))["t"]
    lt = layout.local_tables(mine)["t"]
    out, own = layout.sends(lt, gt, 32, 1)
    assert [(d, a, tuple(t.shape)) for d, a, t in out] == [(0, 5, (27, 16))]
    buf, sizes = layout.pack([[out[0][2]], []])
    assert sizes == [27 * 16 * 4, 0] and buf.numel() == 27 * 16 * 4
    assert torch.equal(layout.unpack(buf, gt, 27)[0], big[5:32])
    assert own[0][0].b0 == 1 and own[0][0].lo == 32


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.float64,
           torch.int8, torch.bool]


@st.composite
def _messages(draw):
    """Row messages for 3 ranks: mixed dtypes, odd row counts of 2-byte rows (so a
    message can end off any alignment), zero rows, zero-width rows, strided views."""
    out = []
    for _ in range(3):
        ms = []
        for _ in range(draw(st.integers(0, 4))):
            dtype = draw(st.sampled_from(_DTYPES))
            shape = (draw(st.integers(0, 7)), *draw(st.sampled_from([(), (0,), (3,), (2, 3)])))
            t = (torch.randn(shape, dtype=torch.float64) * 50).to(dtype)
            if draw(st.booleans()) and t.dim() == 2:
                t = t.t().contiguous().t()  # same values, column-major: not contiguous
            ms.append(t)
        out.append(ms)
    return out


@settings(max_examples=60, deadline=None)
@given(messages=_messages())
def test_packed_rows_unpack_bit_for_bit(messages):
    buf, sizes = layout.pack(messages)
    assert sum(sizes) == buf.numel()
    at = 0
    for ms, size in zip(messages, sizes):
        data = buf[at:at + size]
        at += size
        for t in ms:
            gt = layout.GlobalTable("t", int(t.shape[0]), tuple(t.shape[1:]),
                                    dtype_name(t.dtype), ((0, 0, int(t.shape[0])),))
            got, used = layout.unpack(data, gt, int(t.shape[0]))
            assert used == layout.message_nbytes(gt, int(t.shape[0]))
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(got.reshape(-1).view(torch.uint8) if got.numel() else got,
                               t.contiguous().reshape(-1).view(torch.uint8)
                               if t.numel() else t)
            data = data[used:]
        assert data.numel() == 0


def test_gaps_overlaps_and_disagreements_name_the_ranks():
    t = torch.zeros(10, 2)
    with pytest.raises(InvalidInput, match="rows 4..6 are in no shard"):
        layout.global_tables(_specs({"t": Shard(t[:4], row_offset=0, rows=10)},
                                    {"t": Shard(t[6:], row_offset=6, rows=10)}))
    with pytest.raises(InvalidInput, match="rank 1's rows 3..10 overlap rank 0"):
        layout.global_tables(_specs({"t": Shard(t[:4], row_offset=0, rows=10)},
                                    {"t": Shard(t[3:], row_offset=3, rows=10)}))
    with pytest.raises(InvalidInput, match="rank 1 gives rows of shape"):
        layout.global_tables(_specs({"t": Shard(t[:4], row_offset=0, rows=10)},
                                    {"t": Shard(t[4:].double(), row_offset=4, rows=10)}))
    with pytest.raises(InvalidInput, match="a plain tensor, rank 1 shards"):
        layout.global_tables(_specs({"t": t}, {"t": Shard(t, row_offset=0, rows=10)}))


def test_a_replicated_table_is_stored_by_one_rank():
    t = torch.zeros(10, 2)
    tables = layout.global_tables(_specs({"a": t, "b": t}, {"a": t, "b": t}))
    assert tables["a"].pieces == ((0, 0, 10),) and tables["b"].pieces == ((1, 0, 10),)


def test_a_replicated_table_must_be_the_same_on_every_rank_that_gives_it():
    # Regression (issue 23): it was stored from one rank, the others' values lost silently.
    t = torch.randn(10, 3)
    other = t.clone()
    other[7, 1] = -0.0 if t[7, 1] == 0 else -t[7, 1]
    with pytest.raises(InvalidInput, match="'d': rank 1 gives a plain tensor whose values "
                                           "differ from rank 0's"):
        layout.global_tables(_specs({"d": t}, {"d": other}))
    nan = torch.full((4,), float("nan"))
    same = layout.global_tables(_specs({"d": t, "n": nan}, {"d": t.clone(), "n": nan.clone()}))
    assert same["d"].pieces == ((0, 0, 10),)
    with pytest.raises(InvalidInput, match="'e'"):  # bits, not float equality: -0.0 != 0.0
        layout.global_tables(_specs({"e": torch.zeros(2)}, {"e": -torch.zeros(2)}))


def test_a_run_is_a_view_of_its_shard_and_only_a_mixed_last_block_is_copied():
    # Rank 0's rows 0..77 of 200 at 32 rows a block: its blocks 0-2, block 2 ending in rank
    # 1's rows 77..96. The whole run was assembled into a copy (issue 26: ~30 MB a rank at
    # the bench's size); now blocks 0-1 are a view and only block 2 is copied.
    full = torch.randn(200, 4)
    a = {"t": Shard(full[:77], row_offset=0, rows=200)}
    b = {"t": Shard(full[77:], row_offset=77, rows=200)}
    gt = layout.global_tables(_specs(a, b))["t"]
    assert [(r.rank, r.b0, r.b1, r.lo, r.hi) for r in layout.runs(gt, 32)] == [
        (0, 0, 2, 0, 64), (0, 2, 3, 64, 96), (1, 3, 7, 96, 200)]
    out, own = layout.sends(layout.local_tables(a)["t"], gt, 32, 0)
    assert out == []
    (r1, p1), (r2, p2) = own
    view = layout.assemble(r1, p1, gt.row_shape, gt.torch_dtype)
    assert view.data_ptr() == full.data_ptr() and torch.equal(view, full[:64])
    out1, own1 = layout.sends(layout.local_tables(b)["t"], gt, 32, 1)
    assert [(d, s, tuple(t.shape)) for d, s, t in out1] == [(0, 77, (19, 4))]
    p2.append((77, out1[0][2]))
    assert torch.equal(layout.assemble(r2, p2, gt.row_shape, gt.torch_dtype), full[64:96])


@settings(max_examples=80, deadline=None)
@given(cuts=st.lists(st.integers(0, 120), min_size=1, max_size=5), rows=st.integers(1, 120),
       block=st.sampled_from([1, 7, 16, 32]))
def test_every_rank_works_out_the_rows_each_rank_moves(cuts, rows, block):
    # The check round carries each rank's spec and the touched ids of the rows it moves
    # (moved_ids, known before the specs); every rank then works out every rank's messages
    # (moves): they must be those that rank's sends makes.
    bounds = sorted({0, rows, *[min(c, rows) for c in cuts]})
    pieces = list(zip(bounds, bounds[1:]))
    world = 3
    ranks = [{} for _ in range(world)]
    full = torch.randn(rows, 2)
    for i, (lo, hi) in enumerate(pieces):
        ranks[i % world].setdefault("t", []).append(Shard(full[lo:hi], row_offset=lo, rows=rows))
    given_by = [r for r in range(world) if ranks[r]]
    locs = [layout.local_tables(ranks[r])["t"] for r in given_by]
    gt = layout.global_tables([{"t": lt.spec()} for lt in locs])["t"]
    ids = torch.arange(rows)
    for k, (r, lt) in enumerate(zip(given_by, locs)):
        snd, _ = layout.sends(lt, gt, block, k)
        assert layout.moves(lt.spec(), gt, block, k) == [
            (d, a, int(t.shape[0])) for d, a, t in snd]
        sent = [i for _, a, t in snd for i in range(a, a + int(t.shape[0]))]
        held = [i for lo, t in lt.pieces for i in range(lo, lo + int(t.shape[0]))]
        assert layout.moved_ids(lt, ids[held], block).tolist() == sorted(sent), r

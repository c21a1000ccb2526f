"""The tiling check and block ownership (cnrstore/dist/layout.py), in one process."""

from __future__ import annotations

import pickle

import pytest
import torch

from cnrstore import InvalidInput, Shard
from cnrstore.dist import layout


def _specs(*ranks):
    return [{n: t.spec() for n, t in layout.local_tables(r).items()} for r in ranks]


def test_rows_sent_to_another_rank_carry_only_themselves():
    # Regression: the boundary rows were views of the shard, and pickling a view sends its
    # whole storage: every put all-gathered every rank's whole shards (found by the bench).
    big = torch.randn(100_000, 16)
    mine = {"t": Shard(big[5:], row_offset=5, rows=100_000)}
    other = {"t": Shard(torch.randn(5, 16), row_offset=0, rows=100_000)}
    gt = layout.global_tables(_specs(other, mine))["t"]
    lt = layout.local_tables(mine)["t"]
    out, own = layout.sends(lt, gt, 32, 1)
    assert [(d, a, tuple(t.shape)) for d, a, t in out] == [(0, 5, (27, 16))]
    assert len(pickle.dumps(out)) < 27 * 16 * 4 + 4096
    assert own[0][0].b0 == 1 and own[0][0].lo == 32


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

"""A distributed put stores exactly what a single-process put of the assembled tables
stores: every rank's StepInfo.tables equals the single-process ids, for uneven, empty,
interleaved, replicated and table-wise shards, exact and lossy schemes, over steps with
Zipf row changes; the directory then opens as a plain store with the same tables."""

from __future__ import annotations

import pytest
import torch
from dist_util import (
    BLOCK_ROWS,
    FANOUT,
    Failed,
    oracle,
    oracle_reopened,
    put_reopened,
    put_sequence,
    run,
    sequence,
)

import cnrstore


@pytest.mark.parametrize("world", [1, 3])
def test_table_ids_equal_a_single_process_put(tmp_path, world):
    seed = 7 + world
    want = oracle(str(tmp_path / "oracle"), seed)
    got = run(world, put_sequence, str(tmp_path / "dist"), seed)
    for r, ids in enumerate(got):
        assert not isinstance(ids, Failed), ids.trace
        assert ids == want, f"rank {r}"
    with cnrstore.open(tmp_path / "dist") as s:
        assert s.steps() == [10, 20, 30]
        step, tables, quant = sequence(seed)[-1]
        with cnrstore.open(tmp_path / "oracle") as o:
            expect = o.get_tables(step)
        back = s.get_tables(step)
        for name, t in tables.items():
            assert torch.equal(back[name], expect[name]), name
            if quant.get(name, "exact") == "exact":
                assert torch.equal(back[name], t), name
        assert s.verify().ok


def test_a_fresh_handle_seeds_its_bases_and_nonblocking_puts_match(tmp_path):
    """The first put of a reopened distributed store diffs against the stored step (like a
    single-process fresh handle: same ids, a fraction of the bytes), and puts with
    blocking=False store the same objects."""
    seed = 3
    want, sizes = oracle_reopened(str(tmp_path / "oracle"), seed)
    got = run(2, put_reopened, str(tmp_path / "dist"), seed)
    for r, res in enumerate(got):
        assert not isinstance(res, Failed), res.trace
        ids, written, logical = res
        assert ids == want, f"rank {r}"
        # Record bytes as the single-process put's, plus pack headers and trailers of
        # the ranks' packs; far below the first (full) put.
        assert written < sizes[-1] + 2048 and written < sizes[0] / 2, (written, sizes)


def test_touched_takes_global_row_ids_of_the_ranks_own_rows(tmp_path):
    from dist_workers import _table, touched_put

    t = _table(1)
    with cnrstore.open(tmp_path / "o", block_rows=BLOCK_ROWS, fanout=FANOUT) as o:
        want = [o.put_tables(1, {"t": t.clone()}).tables]
        rows = torch.tensor([3, 76, 77, 78, 150, 199])
        t[rows] += 1.0
        want.append(o.put_tables(2, {"t": t}, touched={"t": rows}).tables)
    for r in run(2, touched_put, str(tmp_path / "d")):
        assert not isinstance(r, Failed), r.trace
        ids, changed, written = r
        assert ids == want and changed == {"t": 6}
        assert written["t"] == 6  # patches: only the touched rows are encoded


@pytest.mark.parametrize("world,max_chain", [(2, 3), (3, 64)])
def test_a_deferred_plan_stores_the_step_a_plan_made_at_once_stores(tmp_path, world,
                                                                   max_chain):
    # A non-blocking tracker-driven put copies the rows in its stall and is planned on the
    # writer thread (core/snapshot.py, issue 26); each rank overwrites its table as soon
    # as its put returns. Every step is the one a single-process blocking put (planned at
    # once) stores, byte for byte: the same ids, through patches, merged patches (a short
    # chain) and full rewrites, boundary blocks assembled from two ranks' rows among them.
    from dist_workers import deferred_puts, tracked_steps

    with cnrstore.open(tmp_path / "o", block_rows=BLOCK_ROWS, fanout=FANOUT,
                       max_chain=max_chain) as o:
        want = [o.put_tables(step, {"t": t}, touched=None if tt is None else {"t": tt}
                             ).tables
                for step, (t, tt) in enumerate(tracked_steps(7, 14), start=1)]
    for r in run(world, deferred_puts, str(tmp_path / "d"), max_chain):
        assert not isinstance(r, Failed), r.trace
        ids, ok = r
        assert ok and ids == want


@pytest.mark.parametrize("world", [2, 3])
def test_boundary_rows_go_point_to_point_to_their_owner(world):
    """Comm.exchange (what a put moves boundary rows with): each rank receives exactly
    the bytes the others packed for it, nothing of what they packed for a third rank."""
    from dist_workers import exchange_rows

    for r, res in enumerate(run(world, exchange_rows)):
        assert not isinstance(res, Failed), res.trace
        received, expect, exact = res
        assert received == expect and exact, f"rank {r}"
        assert received[r] == 0 and sum(received) > 0


@pytest.mark.parametrize("quant,want", [(None, [4, 2]), ("int8", [5, 3])])
def test_a_nonblocking_put_state_takes_few_rounds_on_the_calling_thread(tmp_path, quant,
                                                                       want):
    """The caller's stall of a non-blocking put is mostly waiting in rounds for the other
    ranks (docs/design/torchrec-speed.md). The structure round carries the column join's
    facts; the check round the flattened structure and which rows move where (and which
    of them changed); then the exchange of the boundary rows, on a handle's first put the
    seeding, and where a table has intN codes the widths (an exact or cast table's width
    is known: a rank's planning error rides the writer's first round instead). A later
    put whose structure is the last one's on every rank takes no structure round (each
    rank's verdict rides the check round). Before, the structure took two rounds, the
    column join, the flatten and the rows announced one each: 9 and 8; then 5 and 4 with
    the width round and the structure round at every put."""
    from dist_workers import put_state_rounds

    for r in run(2, put_state_rounds, str(tmp_path / "d"), quant):
        assert not isinstance(r, Failed), r.trace
        rounds, steps, ok = r
        assert steps == [1, 2] and ok
        assert rounds == want, rounds


def test_the_check_round_carries_no_tensor(tmp_path):
    """Every rank unpickles every rank's payload of the check round on the caller's
    thread; a pickled tensor goes through torch.load (~1 ms each: a tracker-driven put at
    4 ranks unpickled ~26 a checkpoint, issue 26). The changed rows that move to a
    block's owner ride it as numpy arrays."""
    from dist_workers import check_round_payload

    for r in run(2, check_round_payload, str(tmp_path / "d")):
        assert not isinstance(r, Failed), r.trace
        types, ok = r
        assert ok
        assert "numpy.ndarray" in types, types  # the moved rows are there
        assert not [t for t in types if t.startswith("torch.")], types


def test_a_structure_changed_on_one_rank_is_agreed_again(tmp_path):
    """A put_state takes the handle's last structure until its check round, where a rank
    whose structure changed (an optimizer state only it holds appears, then goes) makes
    every rank raise Restructure and agree it in the structure round: one round more than
    without the cache; an unchanged one takes none. A bad input found meanwhile on another
    rank is the error of the structure agreed, raised on every rank as before."""
    from dist_workers import changing_structure

    res = run(2, changing_structure, str(tmp_path / "d"))
    for r in res:
        assert not isinstance(r, Failed), r.trace
    assert res[0][1:] == res[1][1:], res
    rounds, errors, steps, ok = res[0]
    assert errors == [None, None, "InvalidInput", None], errors
    assert steps == [1, 2, 4] and all(ok) and len(ok) == 3, (steps, ok)
    # 1: structure, check, rows, seed; 2: check (rank 1 changed), structure, check, rows,
    # seed (the new table); 3: check (rank 1 changed back), structure, check (the gap);
    # 4: check (changed again), structure, check, rows (step 2's bases are kept)
    assert rounds == res[1][0] == [4, 5, 3, 4], res

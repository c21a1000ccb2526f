"""Boundary blocks read once (issue 26): where ranks' destination rows cut a block, one
rank reads it and sends the others their rows of it (cnrstore/distributed/boundary.py,
core/get.py ``share``). Counted on the engine's own reads in each rank: every block a
restore needs is read by exactly one rank, one that wants rows of it, and each of its
records once; the rows equal the saved ones, for weights and optimizer states, at 2-4
ranks with uneven shards; a failure on any side fails the read on every rank with the
same error, within the timeout, and the next read works."""

from __future__ import annotations

import pytest
from boundary_workers import ROWS, block_records, failing, restore, save
from dist_util import Failed, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cnrstore.core.get import share

R = 32  # the saved steps' block rows


def _wanting(cuts: list, b: int, block_rows: int = R) -> list[int]:
    return [r for r, mine in enumerate(cuts)
            if any(lo < (b + 1) * block_rows and hi > b * block_rows for lo, hi in mine)]


def check_reads(res: list, records: dict, cuts: list, block_rows: int = R) -> list[int]:
    """Every rank's rows right; every block some rank wants read by exactly one of those
    that want it, each of its records once; no other block read. Returns the bytes of
    block records each rank read."""
    for r, got in enumerate(res):
        assert not isinstance(got, Failed), got.trace
        assert got[0], f"rank {r}: rows differ from the saved ones"
    read = [set(got[1]) for got in res]
    nbytes = [0] * len(res)
    for (name, b), recs in records.items():
        readers = [r for r, seen in enumerate(read) if recs & seen]
        wanting = _wanting(cuts, b, block_rows)
        if not wanting:
            assert not readers, (name, b, readers)
            continue
        assert len(readers) == 1 and readers[0] in wanting, (name, b, readers, wanting)
        counts = res[readers[0]][1]
        assert all(counts.get(o) == 1 for o in recs), (name, b, [counts.get(o) for o in recs])
        nbytes[readers[0]] += 1
    return nbytes


CUTS = {  # uneven, off the block grid (32 rows), some blocks cut by three ranks
    2: [[(0, 100)], [(100, 300)]],
    3: [[(0, 45)], [(45, 70)], [(70, 300)]],
    4: [[(0, 10)], [(10, 20)], [(20, 161)], [(161, 300)]],
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("boundary") / "s"
    save(str(path))
    return str(path), block_records(str(path), 3)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("how", ["get_tables", "load_state"])
def test_each_block_is_read_by_exactly_one_rank(saved, world, how):
    path, records = saved
    cuts = CUTS[world]
    res = run(world, restore, path, 3, cuts, how)
    check_reads(res, records, cuts)
    # a rank holding a block's first rows but few of them does not read it: the rank
    # holding most of its rows does, and sends the others theirs
    readers = {b: [r for r, got in enumerate(res) if records[("model/w", b)] & set(got[1])]
               for b in range(-(-ROWS // R))}
    if world == 2:
        assert readers[3] == [1]  # rows 96..100 rank 0's, 100..128 rank 1's
    if world == 4:
        assert readers[0] == [2] and readers[5] == [3]  # 12 rows of 32; 161..192: 31 of 32


def test_several_pieces_a_rank_and_empty_ranks(saved):
    path, records = saved
    cuts = [[(0, 40), (200, 230)], [], [(40, 200), (230, 300)]]
    res = run(3, restore, path, 3, cuts, "sharded")
    check_reads(res, records, cuts)


@st.composite
def splits(draw):
    world = draw(st.integers(2, 4))
    bounds = sorted(draw(st.lists(st.integers(0, ROWS), min_size=world + 1,
                                  max_size=2 * world)))
    bounds = [0, *bounds, ROWS]
    cuts: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo:
            cuts[draw(st.integers(0, world - 1))].append((lo, hi))
    return world, cuts


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=splits())
def test_any_split_restores_the_saved_rows_each_block_read_once(saved, spec):
    path, records = saved
    world, cuts = spec
    check_reads(run(world, restore, path, 3, cuts, "sharded"), records, cuts)


@given(spec=splits(), block_rows=st.sampled_from([1, 7, 32, 500]))
@settings(max_examples=300, deadline=None)
def test_the_plan_delivers_every_row_once(spec, block_rows):
    """``share`` alone (no ranks): every wanted row is read by its rank or sent to it by
    exactly one rank that reads its block; no rank reads a block it receives from."""
    world, cuts = spec

    class Node:
        rows, dtype, shape, width = ROWS, "float32", (ROWS, 2), 2
    Node.block_rows = block_rows

    class TM:
        node = Node
    asked = [{"t": (TM, mine, True)} for mine in cuts]
    plans, skips = share(asked)
    got = {r: {} for r in range(world)}  # rank -> row -> how many times it arrives
    reads = {r: set() for r in range(world)}
    for r, mine in enumerate(cuts):
        for lo, hi in mine:
            for b in range(lo // block_rows, -(-hi // block_rows)):
                if ("t", b) not in skips[r]:
                    reads[r].add(b)
                    for x in range(max(lo, b * block_rows), min(hi, (b + 1) * block_rows)):
                        got[r][x] = got[r].get(x, 0) + 1
    sent = {}
    for r, plan in enumerate(plans):
        for tag, dst, _, lo, hi, nbytes in plan[1] if plan else ():
            sent[tag] = (r, dst, lo, hi, nbytes)
            assert lo // block_rows in reads[r] and nbytes == (hi - lo) * 8
    for r, plan in enumerate(plans):
        for tag, src, _, k, lo, hi, nbytes in plan[0] if plan else ():
            assert sent.pop(tag) == (src, r, lo, hi, nbytes)
            assert cuts[r][k][0] <= lo < hi <= cuts[r][k][1]
            for x in range(lo, hi):
                got[r][x] = got[r].get(x, 0) + 1
    assert not sent
    for r, mine in enumerate(cuts):
        assert got[r] == {x: 1 for lo, hi in mine for x in range(lo, hi)}
    for b in range(-(-ROWS // block_rows)):
        wanting = _wanting(cuts, b, block_rows)
        assert len([r for r in range(world) if b in reads[r]]) == min(len(wanting), 1)


@pytest.mark.parametrize("how", ["damaged", "early", "dies"])
def test_a_failing_rank_fails_the_read_everywhere(tmp_path, how):
    path = str(tmp_path / "s")
    save(path)
    cuts = CUTS[2]
    victim = 1  # it reads block 3 for rank 0 (rows 96..100)
    if how == "damaged":
        _damage(path, block_records(path, 3)[("model/w", 3)])
    res = run(2, failing, path, 3, cuts, how, victim, 20.0,
              expect_dead=(victim,) if how == "dies" else ())
    for r, got in enumerate(res):
        if how == "dies" and r == victim:
            continue
        assert not isinstance(got, Failed), got.trace
        err, seconds, after = got
        assert err is not None and seconds < 19, (r, err, seconds)
        if how == "dies":
            assert err[0] == "RankFailed", err
        else:
            assert err == res[0][0], (r, err, res[0][0])  # the same error on every rank
            assert err[1].startswith("rank 1: "), err
            assert after is True or how == "damaged", after
    if how == "damaged":
        assert res[0][0][0] == "CorruptData", res[0][0]


def _damage(path: str, oids: set[bytes]) -> None:
    """Flip a byte in the middle of the largest of ``oids``' records on the disk."""
    import os

    import cnrstore
    from engine.packs.pack import pack_name

    with cnrstore.open(path) as s:
        loc = max(s.objects.locate_closure(list(oids)).values(), key=lambda c: c.length)
    f = os.path.join(path, "packs", pack_name(loc.pack))
    with open(f, "r+b") as fh:
        fh.seek(loc.offset + loc.length // 2)
        b = fh.read(1)
        fh.seek(loc.offset + loc.length // 2)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_a_pack_moved_under_the_reading_rank_reads_again_with_a_new_plan(tmp_path):
    """Rank 1 reads the block it shares with rank 0 and meets a pack a gc by another job
    compacted (remote_workers.moved_read's premise): every rank reads again, with fresh
    locations and a new plan, and gets its rows."""
    import os

    from boundary_workers import moved_boundary

    where = {"path": os.fspath(tmp_path / "shared"),
             "cache": os.fspath(tmp_path / "host{rank}" / "cache"),
             "options": {"gc_grace_s": 0.0}}
    res = run(2, moved_boundary, where, os.fspath(tmp_path / "otherjob"), timeout=120)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    assert [r[:2] for r in res] == [(True, 2)] * 2, res
    assert res[0][2] == [(1, 0)] * 2 and res[1][2] == [(0, 1)] * 2, res  # rank 1 sends


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_torchrec_load_reads_each_row_sharded_block_once(tmp_path, world):
    """ctr.load under a row-wise plan of a step saved table-wise and table-row-wise:
    weights and row-wise Adagrad states each block read by exactly one rank; the
    column-wise table (t2) is read by every rank that holds columns of it (whole rows,
    its pieces' own read: docs/TORCHREC.md)."""
    pytest.importorskip("torchrec")
    import torch
    from boundary_workers import torchrec_restore

    path = str(tmp_path / "s")
    save = {"t0": "tw:0", "t1": "twrw", "t2": f"tw:{world - 1}"}
    load = {"t0": "rw", "t1": "rw", "t2": "cw"}
    res = run(world, torchrec_restore, path, save, load, timeout=300)
    for r in res:
        assert not isinstance(r, Failed), r.trace
    whole = {}
    for p in res[0][0]:
        parts = sorted((o, t) for r in res for o, _, t in r[0][p] if t.shape[0])
        whole[p] = torch.cat([t for _, t in parts])
    records = block_records(path, 1)
    block = 16
    checked = set()
    for p, full in whole.items():
        if "optim" in p and "t2" in p:
            continue  # kept per column piece, mapped through the row's mean (TORCHREC.md)
        cols = any(t.shape[1:] != full.shape[1:] for r in res for _, _, t in r[1][p])
        for r in res:
            for o, c, t in r[1][p]:
                want = full[o:o + t.shape[0]]
                assert torch.equal(t, want[:, c:c + t.shape[1]] if cols else want), p
        for b in range(-(-full.shape[0] // block)):
            wanting = [i for i, r in enumerate(res) if any(
                o < (b + 1) * block and o + t.shape[0] > b * block for o, _, t in r[1][p])]
            readers = [i for i, r in enumerate(res) if records[(p, b)] & set(r[2])]
            if cols:
                assert readers == wanting, (p, b, readers, wanting)
            else:
                assert len(readers) == min(1, len(wanting)), (p, b, readers, wanting)
                assert set(readers) <= set(wanting), (p, b, readers, wanting)
            checked.add((p, cols))
    # weights and optimizer states, row-wise and column-wise, were all checked
    assert {c for _, c in checked} == {True, False}, sorted(checked)
    assert any("optim" in p for p, _ in checked), sorted(checked)

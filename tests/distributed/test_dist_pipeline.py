"""A distributed put and a single-process put share their checks and their seeding
(issue 24): the same ``touched`` values are refused, and a damaged diff base is never
deduplicated onto (its blocks are written so the new step reads back)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from dist_util import BLOCK_ROWS, FANOUT, Failed, run

import cnrstore
from cnrstore.format.load import load_manifest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cnrstore"))
from test_damaged_base import _rot  # noqa: E402 - the same rot as the single-process test

OPTS = {"block_rows": BLOCK_ROWS, "fanout": FANOUT}

CASES = [
    [1.5, 2.0],                   # float row ids: not row ids
    [True, False],                # a mask, not row ids
    [[1, 2], [3, 4]],             # 2-D
    "12",                         # a str
    [3, 70],                      # outside the table
    [3, 7],                       # fine
]


def _plain_refusals(path: pathlib.Path) -> list:
    out = []
    t = torch.arange(64 * 2, dtype=torch.float32).reshape(64, 2)
    with cnrstore.open(path, **OPTS) as s:
        for i, ids in enumerate(CASES):
            try:
                s.put_tables(i, {"t": t}, touched={"t": ids})
                out.append(None)
            except cnrstore.CheckpointError as exc:
                out.append(type(exc).__name__)
    return out


def test_touched_is_refused_as_by_a_single_process_put(tmp_path):
    from pipeline_workers import touched_refusals

    want = _plain_refusals(tmp_path / "plain")
    assert want[-1] is None and all(want[:-1]), want
    for r, got in enumerate(run(2, touched_refusals, str(tmp_path / "d"), CASES)):
        assert not isinstance(got, Failed), got.trace
        assert got == want, f"rank {r}"


@pytest.mark.parametrize("scheme", ["exact", "int8"])
def test_a_rotten_base_block_is_not_reused_by_a_distributed_put(tmp_path, scheme):
    from pipeline_workers import put_over_rot

    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(5)
    t = torch.randn(128, 4, generator=g)
    with cnrstore.open(path, compression_level=0, **OPTS) as s:
        s.put_tables(1, {"t": t}, quant=scheme)
        t[40] += 1  # block 1 changes; block 0 of step 2 is step 1's block
        s.put_tables(2, {"t": t}, quant=scheme)
        block0 = load_manifest(s.objects, 2).tables["t"].block_ids[0]
        _rot(path, s.objects.get(block0).payload)
    t[100] += 1  # block 3 changes; block 0 is unchanged (same content as the rotten one)
    with cnrstore.open(tmp_path / "oracle", compression_level=0, **OPTS) as o:
        o.put_tables(1, {"t": t}, quant=scheme)
        want = o.get_tables(1)["t"]
    got = run(2, put_over_rot, str(path), t, scheme)
    with cnrstore.open(path, **OPTS) as s:
        assert torch.equal(s.get_tables(3)["t"], want)
        report = s.verify()
        assert not any("step 3" in p for p in report.problems), report.problems
    for r, res in enumerate(got):
        assert not isinstance(res, Failed), res.trace
        assert res[1] == 1, f"rank {r}: {res}"  # counted as a single-process put counts


def test_queued_puts_seed_moved_blocks_once_the_puts_before_them_are_in(tmp_path):
    # A block whose owner changed is seeded from the store (its new owner holds no base
    # of it). Read while the puts before were still queued, the base was an older step's
    # (or none), and the ids depended on how far the writer had got; read after them, as
    # a world of one seeds, they are the ids of a single process's puts.
    from pipeline_workers import moving_queued, moving_steps

    res = run(2, moving_queued, str(tmp_path / "d"))
    for r in res:
        assert not isinstance(r, Failed), r.trace
    with cnrstore.open(tmp_path / "o", **OPTS) as o:
        want = [o.put_tables(step, {"t": t}).tables for step, t in enumerate(moving_steps())]
    assert res[0] == res[1] == want

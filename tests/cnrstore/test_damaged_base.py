"""A damaged or absent diff base never stops a checkpoint (issue 8, item 7 and "Seeding
reads only the highest step"): a fresh handle seeds a table from the newest stored step
that holds it, and blocks whose stored base cannot be read are written in full (counted
in StepInfo.rewritten_blocks), so the new step restores exactly."""

from __future__ import annotations

import pathlib

import pytest
import torch
from ckpt_util import assert_identical, random_table

import cnrstore
from cnrstore.format.load import load_manifest

OPTS = {"block_rows": 16, "fanout": 4}


def _rot(path: pathlib.Path, payload: bytes) -> None:
    """Flip a byte inside ``payload`` where it lies in a pack (stored raw: level 0)."""
    probe = payload[len(payload) // 2:len(payload) // 2 + 48]
    hits = []
    for pack in path.glob("packs/*/*.pack"):
        raw = pack.read_bytes()
        at = raw.find(probe)
        if at >= 0:
            hits.append((pack, at))
    assert hits, "payload not found in any pack"
    for pack, at in hits:
        raw = bytearray(pack.read_bytes())
        raw[at + 5] ^= 0x5A
        pack.write_bytes(bytes(raw))


@pytest.mark.parametrize("scheme", ["exact", "int8"])
def test_rot_in_the_newest_step_does_not_stop_the_next_put(tmp_path, scheme):
    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(3)
    t = random_table(g, 64, 8)
    with cnrstore.open(path, compression_level=0, **OPTS) as s:
        s.put_tables(1, {"t": t}, quant=scheme)
        t[20] += 1  # block 1 changes; block 0 of step 2 is step 1's block
        s.put_tables(2, {"t": t}, quant=scheme)
        block0 = load_manifest(s.objects, 2).tables["t"].block_ids[0]
        _rot(path, s.objects.get(block0).payload)
    with cnrstore.open(path, **OPTS) as s:
        with pytest.raises(engine_error()):
            s.get_tables(2)
        t[40] += 1  # block 2 changes; block 0 is unchanged (same content as the rotten one)
        info = s.put_tables(3, {"t": t}, quant=scheme)
        assert info.rewritten_blocks == 1
        got = s.get_tables(3)["t"]
        if scheme == "exact":
            assert_identical(got, t)
        else:
            with cnrstore.open(tmp_path / "ref", **OPTS) as r:
                r.put_tables(0, {"t": t}, quant=scheme)
                assert_identical(got, r.get_tables(0)["t"])
        report = s.verify()
        assert not report.ok
        assert not any("step 3" in p for p in report.problems), report.problems
        # The next put diffs against step 3 again: one changed row, one patch row.
        t[50] += 1
        info = s.put_tables(4, {"t": t}, quant=scheme)
        assert info.rows_written == {"t": 1} and info.rewritten_blocks == 0
        if scheme == "exact":
            assert_identical(s.get_tables(4)["t"], t)


def engine_error():
    import engine

    return (engine.StoreError, cnrstore.CheckpointError)


def test_seed_from_the_newest_step_holding_the_table(tmp_path):
    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(4)
    a, b = random_table(g, 256, 8), random_table(g, 8, 2)
    with cnrstore.open(path, **OPTS) as s:
        s.put_tables(1, {"a": a, "b": b})
        s.put_tables(2, {"b": b})  # step 2 lacks "a"
    with cnrstore.open(path, **OPTS) as s:
        a[100] += 1
        info = s.put_tables(3, {"a": a})
        assert info.rows_changed == {"a": 1}
        assert info.rows_written == {"a": 1}
        assert info.rewritten_blocks == 0
        assert_identical(s.get_tables(3)["a"], a)

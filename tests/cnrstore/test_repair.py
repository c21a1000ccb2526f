"""A repair never makes readable data unreadable (issue 23, item 1): one flipped byte in
one data pack used to make ``cnrstore repair`` drop every step reaching it ("dangling-root
... dropped"), although every other table was still readable. Now it keeps every step
that partly reads, says so first, and ``--dry-run`` changes nothing."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from ckpt_util import assert_identical
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cnrstore
import engine
from cnrstore.format.load import list_steps, load_manifest
from cnrstore.tools import info as ci
from engine.packs.pack import list_pack_files

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _make(path: pathlib.Path, *, rows: int = 400, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(1)
    tables = {"user": torch.randn(rows, 8, generator=gen),
              "item": torch.randn(rows // 2, 4, generator=gen),
              "ids": torch.arange(rows // 4)}
    with cnrstore.open(path, block_rows=64, fanout=4) as s:
        for step in range(steps):
            tables["user"][step * 10:(step + 1) * 10] += 1
            s.put_tables(step, tables)


def _flip_block(path: pathlib.Path, table: str, block: int = 0) -> bytes:
    """Flip one payload byte of a block of ``table`` (step 0); return the block's id."""
    with engine.open(path, create=False) as objects:
        manifest = load_manifest(objects, 0, names=[table])
        oid = manifest.tables[table].segments[0].block_ids[block]
        loc = objects.locate([oid])[oid]
    pack = list_pack_files(path)[loc.pack]
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + 44 + 16 * len(loc.refs) + 3] ^= 0x10  # inside the payload
    pack.write_bytes(bytes(raw))
    return oid


def _readable(path: pathlib.Path) -> dict[tuple[int, str], torch.Tensor | None]:
    """(step, table) -> the table as it reads, or None where it raises CorruptData; steps
    whose own node does not read are absent."""
    names: dict[int, list[str]] = {}
    with engine.open(path, create=False, readonly=True) as objects:
        for step in list_steps(objects):
            try:
                names[step] = list(load_manifest(objects, step, names=[]).node.tables)
            except (cnrstore.CorruptData, engine.StoreError):
                pass
    out: dict[tuple[int, str], torch.Tensor | None] = {}
    with cnrstore.open(path, readonly=True) as s:
        for step, tables in names.items():
            for name in tables:
                try:
                    out[step, name] = s.get_tables(step, names=[name])[name]
                except cnrstore.CorruptData:
                    out[step, name] = None
    return out


def _files(path: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "cnrstore", *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)


def test_repair_after_a_flipped_data_byte_keeps_every_step(tmp_path):
    path = tmp_path / "s"
    _make(path)
    lost = _flip_block(path, "user")
    with cnrstore.open(path) as s:
        before = {st: s.get_tables(st, names=["item", "ids"]) for st in s.steps()}
    done = _cli("repair", str(path))
    assert done.returncode == 1, done.stderr  # damage found
    with cnrstore.open(path) as s:
        assert s.steps() == [0, 1, 2]  # (all three were dropped)
        for step, tables in before.items():
            got = s.get_tables(step, names=["item", "ids"])
            for name, t in tables.items():
                assert_identical(got[name], t)
            with pytest.raises(cnrstore.MissingObject,
                               match=f"table 'user' block 0 .*{lost.hex()}"):
                s.get_tables(step, names=["user"])
            with pytest.raises(cnrstore.CorruptData, match=lost.hex()):
                s.get_tables(step)
        # rows of 'user' outside the lost block still read
        part = s.get_tables(2, names=["user"], rows={"user": slice(64, 400)})["user"]
        assert part.shape == (336, 8)
        assert not s.verify().ok  # the loss stays visible
    plan, result = done.stdout.split("index rebuilt:")
    assert "repair plan:" in plan and "dry run" not in plan
    for step in range(3):
        assert f"step {step}: keeps it: tables 'user' raise CorruptData" in plan
    assert "dangling-root" not in done.stdout and "dropped" not in plan
    assert "3 damaged, 0 dropped" in result


def test_repair_dry_run_changes_nothing_and_says_what_it_would_do(tmp_path):
    path = tmp_path / "s"
    _make(path)
    lost = _flip_block(path, "item", block=1)
    before = _files(path)
    done = _cli("repair", "--dry-run", str(path))
    assert done.returncode == 1, done.stderr
    assert _files(path) == before
    assert done.stdout.startswith("repair plan (dry run: nothing is changed)")
    assert "index rebuilt" not in done.stdout
    assert f"object {lost.hex()}" in done.stdout and "record skipped" in done.stdout
    for step in range(3):
        assert f"step {step}: would keep it: tables 'item' raise CorruptData" in done.stdout
    done = _cli("repair", "--dry-run", "--json", str(path))
    assert _files(path) == before
    doc = json.loads(done.stdout)
    assert doc["dry_run"] is True
    assert [(r["step"], r["action"], r["tables"], r["lost"]) for r in doc["roots"]] == [
        (step, "damaged", ["item"], [lost.hex()]) for step in range(3)]
    skipped = [p for p in doc["damaged"] if p["what"] == "corrupt"]
    assert [p["oid"] for p in skipped] == [lost.hex()] and skipped[0]["pack"]


def test_python_api_dry_run_matches_the_repair(tmp_path):
    path = tmp_path / "s"
    _make(path)
    _flip_block(path, "user")
    before = _files(path)
    plan = ci.repair(path, dry_run=True)
    with engine.open(path, create=False) as objects:
        engine_plan = objects.repair(dry_run=True)
    assert _files(path) == before
    assert engine_plan.dry_run and engine_plan.roots[0].node is not None
    seen = []
    result = ci.repair(path, on_plan=seen.append)
    assert [p.dry_run for p in (plan, seen[0], result)] == [True, False, False]
    assert plan.roots == seen[0].roots == result.roots
    assert [(r.step, r.tables) for r in result.roots] == [(s, ("user",)) for s in range(3)]
    assert (plan.roots_restored, result.roots_restored) == (4, 4)  # 3 steps + options


def test_a_lost_table_node_keeps_the_steps_other_tables(tmp_path):
    # A whole table node lost (its meta record damaged): the step is kept, the table named.
    path = tmp_path / "s"
    _make(path, steps=1)
    with engine.open(path, create=False) as objects:
        oid = load_manifest(objects, 0, names=["item"]).tables["item"].oid
        loc = objects.locate([oid])[oid]
    pack = list_pack_files(path)[loc.pack]
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + loc.length - 20] ^= 1
    pack.write_bytes(bytes(raw))
    result = ci.repair(path)
    assert [(r.step, r.action, r.tables, r.lost) for r in result.roots] == [
        (0, "damaged", ("item",), (oid,))]
    with cnrstore.open(path) as s:
        assert s.steps() == [0]
        assert set(s.get_tables(0, names=["user", "ids"])) == {"user", "ids"}
        with pytest.raises(cnrstore.CorruptData, match=oid.hex()):
            s.get_tables(0, names=["item"])


def _small(path: pathlib.Path) -> None:
    gen = torch.Generator().manual_seed(2)
    tables = {"a": torch.randn(48, 4, generator=gen), "b": torch.randn(20, 2, generator=gen)}
    with cnrstore.open(path, block_rows=16, fanout=2, compression_level=0) as s:
        s.put_tables(0, tables)
        tables["a"][3] += 1
        s.put_tables(1, tables)


def _flip_and_repair(path: pathlib.Path, pick: int, at: float, bit: int) -> None:
    """Flip one bit of one pack of a small store, repair: every step that read survives,
    every table that read reads the same."""
    _small(path)
    packs = sorted(list_pack_files(path).values())
    pack = packs[pick % len(packs)]
    raw = bytearray(pack.read_bytes())
    raw[int(at * len(raw))] ^= 1 << bit
    pack.write_bytes(bytes(raw))
    before = _readable(path)
    steps_before = sorted({s for s, _ in before})
    ci.repair(path)
    after = _readable(path)
    assert sorted({s for s, _ in after}) >= steps_before  # every step that read survives
    for key, table in before.items():
        if table is not None:
            got = after.get(key)
            assert got is not None, key
            assert_identical(got, table)


FLIPS = dict(pick=st.integers(0, 1 << 30), at=st.floats(0, 1, exclude_max=True),
             bit=st.integers(0, 7))


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**FLIPS)
def test_a_flipped_byte_anywhere_in_a_pack_never_makes_a_table_unreadable(
        tmp_path_factory, pick, at, bit):
    _flip_and_repair(tmp_path_factory.mktemp("flip") / "s", pick, at, bit)


@pytest.mark.slow
@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**FLIPS)
def test_a_flipped_byte_anywhere_in_a_pack_long(tmp_path_factory, pick, at, bit):
    _flip_and_repair(tmp_path_factory.mktemp("flip") / "s", pick, at, bit)


def test_a_kept_damaged_step_heals_when_its_block_is_put_again(tmp_path):
    # Lost objects stay unindexed, so a put of the same content writes them anew; gc
    # refuses until then (it cannot tell a lost object from a lost index entry).
    path = tmp_path / "s"
    _make(path)
    with cnrstore.open(path) as s:
        want = {st: s.get_tables(st) for st in s.steps()}
    _flip_block(path, "user")
    ci.repair(path)
    with cnrstore.open(path) as s:
        with pytest.raises(cnrstore.CorruptData, match="gc refused"):
            s.gc()
        s.put_tables(5, {"user": want[0]["user"]})  # a fresh handle writes whole blocks
        for step, tables in want.items():
            got = s.get_tables(step)
            for name, t in tables.items():
                assert_identical(got[name], t)
        assert s.verify().ok
        assert s.gc(keep_last=1).steps_deleted == (0, 1, 2)

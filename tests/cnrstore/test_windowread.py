"""get_tables reads a few blocks at a time, each file forwards (cnrstore/core/windowread.py):
a window's patches first in (pack, offset) order, then its full blocks into the output, no
read-ahead hints; the result and every check stay as a block-by-block read's."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cnrstore
from cnrstore.core import windowread
from cnrstore.format.blocks import KIND_BLOCK_FULL, KIND_BLOCK_PATCH
from cnrstore.format.load import load_manifest
from engine.format.names import pack_path

ROWS, DIM = 64, 8  # block_rows 64: a block is 2 KiB


def _store(path, tables: dict[str, int], steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A store at ``path`` whose latest step (``steps``) has a patch chain in every block."""
    g = torch.Generator().manual_seed(seed)
    t = {n: torch.randn(rows, DIM, generator=g) for n, rows in tables.items()}
    with cnrstore.open(path, block_rows=ROWS) as s:
        s.put_tables(0, t)
        for step in range(1, steps + 1):
            for v in t.values():
                v[step::ROWS // 2] += 1.0  # two rows of every block change
            s.put_tables(step, t)
    return t


def test_patches_in_file_order_then_full_blocks_and_no_hints(tmp_path, monkeypatch):
    tables = _store(tmp_path / "s", {"a": ROWS * 5, "b": ROWS * 4 + 7}, steps=3)
    monkeypatch.setattr(windowread, "WINDOW_BYTES", 3 * ROWS * DIM * 4)  # 3 blocks a window
    logs: dict[str, list] = {}  # each decode thread's reads, in its order

    def note(item) -> None:
        name = threading.current_thread().name
        if name.startswith("cnr-decode"):  # not the deferred diff base's re-read
            logs.setdefault(name, []).append(item)

    with cnrstore.open(tmp_path / "s") as s:
        o = s.objects
        for name in ("get_at", "get_into_at"):
            real = getattr(o, name)
            monkeypatch.setattr(o, name, lambda loc, *a, _r=real, **k: (
                note((loc.kind, loc.pack, loc.offset)), _r(loc, *a, **k))[1])
        real_many = o.get_many_at  # a window's patch records: one batched read
        monkeypatch.setattr(o, "get_many_at", lambda locs, _r=real_many, **kw: (
            [note((loc.kind, loc.pack, loc.offset)) for loc in locs], _r(locs, **kw))[1])
        real_locate = o.locate_closure
        monkeypatch.setattr(o, "locate_closure", lambda oids: (
            note("window"), real_locate(oids))[1])
        monkeypatch.setattr(o._core, "advise", lambda locs: note("hint"))
        back = s.get_tables(3)
        assert all(torch.equal(back[n], v) for n, v in tables.items())
    windows: list[list] = []
    for log in logs.values():
        assert "hint" not in log
        for item in log:
            if item == "window":
                windows.append([])
            else:
                windows[-1].append(item)
    assert len(windows) == 4  # 5 + 5 blocks, 3 a window: tables run on into each other
    assert sum(k == KIND_BLOCK_PATCH for w in windows for k, _, _ in w) >= 3 * 9
    for w in windows:
        kinds = [k for k, _, _ in w]
        npatch = kinds.count(KIND_BLOCK_PATCH)
        assert kinds.count(KIND_BLOCK_FULL) == len(w) - npatch > 0
        assert kinds[:npatch] == [KIND_BLOCK_PATCH] * npatch  # patches first,
        patches = [(p, off) for _, p, off in w[:npatch]]
        assert patches == sorted(patches)  # in file order
        fulls = [(p, off) for _, p, off in w[npatch:]]
        assert fulls == sorted(fulls)  # and the full blocks forwards too


def test_a_damaged_patch_is_reported_naming_its_table_and_block(tmp_path):
    tables = _store(tmp_path / "s", {"a": ROWS * 4}, steps=2)
    with cnrstore.open(tmp_path / "s") as s:
        tm = load_manifest(s.objects, 2).tables["a"]
        oid = tm.block_ids[2]
        loc = s.objects.locate_closure([oid])[oid]
        assert loc.kind == KIND_BLOCK_PATCH
    with open(pack_path(tmp_path / "s", loc.pack), "r+b") as f:
        at = loc.offset + loc.length - 16  # in the payload, before the checksum
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
        os.fsync(f.fileno())
    with cnrstore.open(tmp_path / "s") as s:
        with pytest.raises(cnrstore.CorruptData, match=r"table 'a' block 2 \(rows 128\.\.191\)"):
            s.get_tables(2)
        back = s.get_tables(1)  # the step below never read that patch
        assert back["a"].shape == tables["a"].shape


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.integers(1, ROWS * 6), min_size=1, max_size=3),
       steps=st.integers(0, 3), window_blocks=st.integers(1, 7),
       lo=st.integers(0, ROWS * 6), span=st.integers(0, ROWS * 3), stride=st.integers(1, 70))
def test_windowed_reads_equal_the_tables(tmp_path_factory, monkeypatch, rows, steps,
                                         window_blocks, lo, span, stride):
    path = tmp_path_factory.mktemp("w") / "s"
    names = {f"t{i}": r for i, r in enumerate(rows)}
    tables = _store(path, names, steps, seed=len(rows) + steps)
    monkeypatch.setattr(windowread, "WINDOW_BYTES", window_blocks * ROWS * DIM * 4)
    with cnrstore.open(path) as s:
        back = s.get_tables(steps)
        assert all(torch.equal(back[n], v) for n, v in tables.items())
        sel = slice(lo, lo + span, stride)
        part = s.get_tables(steps, rows={n: sel for n in names})
        assert all(torch.equal(part[n], v[sel]) for n, v in tables.items())

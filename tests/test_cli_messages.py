"""What the ``cnrstore`` command says (issue 23, item 15): a file given as the store, the
``latest`` step, one count of unreachable objects for du and gc, a listing that goes on
past a damaged step, and plural agreement in every renderer."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import cnrstore
from cnrstore.cli import fmt
from cnrstore.cli.app import main
from cnrstore.format.manifest import root_name
from cnrstore.tools import info as ci
from engine.packs.pack import pack_path

pytest.importorskip("safetensors")


@pytest.fixture
def store(tmp_path):
    gen = torch.Generator().manual_seed(0)
    user = torch.randn(64, 8, generator=gen)
    path = tmp_path / "store"
    with cnrstore.open(path, block_rows=16, fanout=4) as s:
        s.put_tables(10, {"user": user, "ids": torch.arange(20)})
        user[3] += 1
        s.put_tables(20, {"user": user})
        user[40] += 1
        s.put_tables(30, {"user": user})
    return path


def _json(capsys, argv: list[str]) -> tuple[int, object]:
    capsys.readouterr()
    code = main(argv + ["--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def test_ls_of_a_file_says_it_is_a_file(store, capsys):
    assert main(["ls", str(store / "index" / "data.mdb")]) == 2
    err = capsys.readouterr().err
    assert "is a file, not a store directory" in err and "directory not found" not in err


def test_latest_names_the_highest_step(store, tmp_path, capsys):
    code, shown = _json(capsys, ["show", str(store), "latest"])
    assert code == 0 and shown["step"] == 30
    code, diff = _json(capsys, ["diff", str(store), "10", "latest"])
    assert code == 0 and (diff["a"], diff["b"]) == (10, 30)
    code, rep = _json(capsys, ["verify", str(store), "--step", "latest"])
    assert code == 0 and rep["steps_checked"] == 1
    out = tmp_path / "latest.safetensors"
    code, done = _json(capsys, ["export", str(store), "latest", str(out)])
    assert code == 0 and done["step"] == 30
    empty = tmp_path / "empty"
    cnrstore.open(empty).close()
    assert main(["show", str(empty), "latest"]) == 2
    assert "no latest step" in capsys.readouterr().err
    assert main(["show", str(store), "newest"]) == 2  # only the one word
    assert "or latest" in capsys.readouterr().err


def test_du_and_gc_count_the_same_unreachable_objects(store, capsys):
    # A fresh store: every object is reached by a root (the options root included).
    code, du = _json(capsys, ["du", str(store)])
    code2, plan = _json(capsys, ["gc", str(store), "--dry-run"])
    assert code == code2 == 0
    assert du["garbage_objects"] == plan["garbage_objects"] == 0
    with cnrstore.open(store) as s:
        s.delete_steps([20, 30])
    _, du = _json(capsys, ["du", str(store)])
    _, plan = _json(capsys, ["gc", str(store), "--dry-run"])
    assert du["garbage_objects"] == plan["garbage_objects"] > 0
    assert plan["objects_freed"] == 0  # nothing more to drop: all of it is garbage already
    code, done = _json(capsys, ["gc", str(store)])
    assert code == 0 and done["objects_freed"] == du["garbage_objects"]
    _, du = _json(capsys, ["du", str(store)])
    assert du["garbage_objects"] == 0


def _rot_step_node(path, step: int) -> None:
    """Flip the last byte of the record holding ``step``'s node (its payload's checksum
    then fails), leaving every other step as it was."""
    with cnrstore.open(path) as s:
        oid = s.objects.root(root_name(step))
        loc = s.objects.locate([oid])[oid]
    pack = pack_path(path, loc.pack)
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + loc.length - 1] ^= 0xFF
    pack.write_bytes(bytes(raw))


def test_ls_lists_the_other_steps_and_marks_a_damaged_one(store, capsys):
    _rot_step_node(store, 20)
    capsys.readouterr()
    assert main(["ls", str(store)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split()[-1] == "PROBLEM"
    rows = {ln.split()[0]: ln for ln in lines[1:]}
    assert set(rows) == {"10", "20", "30"}
    assert "DAMAGED" in rows["20"] and "DAMAGED" not in rows["10"] + rows["30"]
    assert "1 step cannot be read (20)" in captured.err and "cnrstore verify" in captured.err
    code, steps = _json(capsys, ["ls", str(store)])
    assert code == 1
    by_step = {s["step"]: s for s in steps}
    assert by_step[20]["problem"] and by_step[20]["stored_bytes"] is None
    assert by_step[10]["problem"] is None and by_step[30]["stored_bytes"] > 0


_ONE = re.compile(r"(?<![\d.,/])\b1 [a-z]+s\b")


def _ones(value):
    """A result of the real renderer's input type with every count set to 1."""
    changes = {f.name: 1 for f in dataclasses.fields(value)
               if isinstance(getattr(value, f.name), int)
               and not isinstance(getattr(value, f.name), bool)
               and f.name not in ("step", "a", "b") and not f.name.endswith("bytes")}
    return dataclasses.replace(value, **changes)


def test_every_count_agrees_in_number(store, tmp_path, capsys):
    """The renderers get real results with each count set to 1; no "1 objects"."""
    with cnrstore.open(store) as s:
        report = ci.collect(s, keep_last=None)
        result = ci.verify(s)
        plan = ci.gc_plan(s, keep_last=1)
        usage = ci.disk_usage(s)
        diff = ci.diff_steps(s, 10, 20)
    repaired = ci.repair(store)
    texts = {
        "gc": fmt.gc_text(dataclasses.replace(_ones(report), grace_s=3600.0)),
        "gc --dry-run": fmt.gc_plan_text(_ones(plan)),
        "verify": fmt.verify_text(_ones(result)),
        "du": fmt.usage_text(_ones(usage)),
        "repair": fmt.repair_text(_ones(repaired)),
        "ranges": fmt.ranges_text([(0, 1)], limit=0),
        "diff": fmt.diff_text(diff, max_rows=20),
    }
    assert "1 object live" in texts["gc"] and "1 pack (" in texts["gc"]
    assert "1 unreachable" in texts["du"] and texts["ranges"] == "... (1 row in all)"
    for name, text in texts.items():
        assert not _ONE.search(text), f"{name}: {text!r}"
    # and through the command, where the store's own counts come to 1
    one = tmp_path / "one"
    with cnrstore.open(one, block_rows=16) as s:
        s.put_tables(1, {"t": torch.ones(4, 2)})
    for argv in (["ls"], ["show", "1"], ["du"], ["verify"], ["gc", "--dry-run"], ["gc"]):
        assert main([argv[0], str(one), *argv[1:]]) == 0
        out = capsys.readouterr().out
        assert not _ONE.search(out), f"{argv}: {out!r}"

"""``cnrstore changes STORE A B --out FILE`` and ``--apply FILE --to REPLICA`` (issue 28):
the file holds per table an int64 ids tensor and a values tensor with the steps and
schemes in its header; replaying it (the command, or the plain-torch lines of
docs/GUIDE.md) onto an export of step A gives step B."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import cnrstore
from cnrstore.cli.app import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path):
    gen = torch.Generator().manual_seed(0)
    user = torch.randn(200, 8, generator=gen)
    path = tmp_path / "store"
    with cnrstore.open(path, block_rows=16, fanout=4) as s:
        s.put_tables(10, {"user": user.clone(), "model/emb.w": torch.arange(50),
                          "gone": torch.ones(3)})
        user[[7, 8, 150]] += 1
        user = torch.cat([user, torch.randn(5, 8, generator=gen)])
        s.put_tables(20, {"user": user.clone(), "model/emb.w": torch.arange(50),
                          "new": torch.randn(4, 2, generator=gen)}, quant={"user": "int8"})
    return path


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n


def test_changes_file_replays_onto_an_export(store, tmp_path, capsys):
    out, replica = tmp_path / "ch.safetensors", tmp_path / "replica.safetensors"
    assert main(["export", str(store), "10", str(replica)]) == 0
    capsys.readouterr()
    assert main(["changes", str(store), "10", "20", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["a"], result["b"]) == (10, 20) and result["rows"] > 0
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    head = json.loads(meta["cnrstore.changes"])
    assert (head["a"], head["b"]) == (10, 20) and (meta["cnrstore.a"], meta["cnrstore.b"]) \
        == ("10", "20")
    assert json.loads(meta["cnrstore.schemes"])["user"] == ["exact", "int8"]
    kinds = {n: t["kind"] for n, t in head["tables"].items()}
    assert kinds == {"user": "reshaped", "gone": "dropped", "new": "added"}
    tensors = load_file(str(out))
    assert tensors["rows/user"].dtype == torch.int64
    assert tensors["values/user"].shape == (len(tensors["rows/user"]), 8)
    assert main(["changes", "--apply", str(out), "--to", str(replica)]) == 0
    with cnrstore.open(store) as s:
        want = s.get_tables(20)
    _same(load_file(str(replica)), want)
    with safe_open(str(replica), framework="pt") as f:
        assert f.metadata()["cnrstore.step"] == "20"
    # A replica of another step is refused, the file left as it was.
    before = replica.read_bytes()
    assert main(["changes", "--apply", str(out), "--to", str(replica)]) == 2
    assert replica.read_bytes() == before


def test_changes_rollback_and_table_filter(store, tmp_path):
    out = tmp_path / "back.safetensors"
    assert main(["changes", str(store), "20", "10", "--out", str(out), "--table", "user"]) == 0
    head = json.loads(safe_open(str(out), framework="pt").metadata()["cnrstore.changes"])
    assert list(head["tables"]) == ["user"] and head["tables"]["user"]["shape"] == [200, 8]
    assert main(["changes", str(store), "20", "10", "--out", str(out)]) == 2  # exists
    assert main(["changes", str(store), "20", "11", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
    assert main(["changes", str(store), "20", "--out", str(tmp_path / "x")]) == 2  # usage


def test_changes_command_in_a_subprocess(store, tmp_path):
    out = tmp_path / "ch.safetensors"
    proc = subprocess.run([sys.executable, "-m", "cnrstore.cli.app", "changes", str(store),
                           "10", "20", "--out", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                      "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "changes 10 -> 20" in proc.stdout and out.exists()

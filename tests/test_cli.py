"""The ``cnrstore`` command against real stores made through the public API.

Each subprocess run pays for importing torch (seconds on a busy machine), so a handful of
tests run the real command in a subprocess (exit codes, one-line errors, JSON, the console
script); the others call ``cnrstore.cli.app.main(argv)`` in-process, which is the same parser
and code path without the process boundary.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import cnrstore
from cnrstore.cli import fmt
from cnrstore.cli.app import main
from cnrstore.tools import info as ci

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    cmd = ([str(pathlib.Path(sys.executable).with_name("cnrstore"))] if script
           else [sys.executable, "-m", "cnrstore.cli.app"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)


@pytest.fixture
def store(tmp_path):
    gen = torch.Generator().manual_seed(0)
    user = torch.randn(200, 8, generator=gen)
    path = tmp_path / "store"
    with cnrstore.open(path, block_rows=16, fanout=4) as s:
        s.put_tables(10, {"user": user, "ids": torch.arange(50)}, metadata={"epoch": 1})
        user[[7, 8, 150]] += 1
        s.put_tables(20, {"user": user, "ids": torch.arange(50)})
        user[0] -= 1
        s.put_tables(30, {"user": user, "ids": torch.arange(50)}, quant={"user": "int8"})
    return path


def _corrupt(path: pathlib.Path) -> None:
    pack = max(path.glob("packs/*/*.pack"), key=lambda p: p.stat().st_size)
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pack.write_bytes(bytes(data))


# -- the real command in a subprocess ------------------------------------------------------

def test_verify_json_and_exit_code_in_a_subprocess(store):
    _corrupt(store)
    proc = run("verify", str(store), "--deep", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == ""  # not a terminal: no progress bar, no noise
    report = json.loads(proc.stdout)
    assert report["ok"] is False and report["steps_checked"] == 3
    assert report["problems"] and all(p["message"] for p in report["problems"])


def test_errors_are_one_line_with_usage_exit_code(store):
    proc = run("show", str(store), "99", script=True)  # the installed console script
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip() == "cnrstore show: error: step 99 not found (StepNotFound)"
    assert "Traceback" not in proc.stderr


# -- the same entry point in-process ---------------------------------------------------------

def test_ls_json_matches_the_python_api(store, capsys):
    assert main(["ls", str(store), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == fmt.jsonable(ci.list_steps(store))
    assert [s["step"] for s in got] == [10, 20, 30]
    assert main(["ls", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["STEP", "TIME", "(UTC)", "TABLES", "LOGICAL", "STORED", "NEW"]
    assert [ln.split()[0] for ln in lines[1:]] == ["10", "20", "30"]


def test_diff_human_output_names_rows(store, capsys):
    assert main(["diff", str(store), "10", "20"]) == 0
    out = capsys.readouterr().out
    assert "~ user: 2 blocks, 3 rows" in out
    assert "rows: 7-8, 150" in out
    assert "= ids: unchanged" in out
    assert main(["diff", str(store), "20", "30", "--no-rows"]) == 0
    assert "re-encoded (exact 200x8 -> int8 200x8)" in capsys.readouterr().out


def test_missing_store_and_debug(store, tmp_path, capsys):
    assert main(["ls", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no store at" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "nowhere").exists()  # read-only commands create nothing
    (tmp_path / "empty").mkdir()
    assert main(["repair", str(tmp_path / "empty")]) == 2
    assert "no index/ or packs/ inside" in capsys.readouterr().err
    assert list((tmp_path / "empty").iterdir()) == []
    with pytest.raises(cnrstore.StepNotFound):
        main(["--debug", "show", str(store), "99"])


def test_show_and_du(store, capsys):
    assert main(["show", str(store), "30"]) == 0
    out = capsys.readouterr().out
    assert "metadata" not in out  # step 30 has none
    assert "user   200x8  float32  int8" in out
    assert main(["show", str(store), "10"]) == 0
    assert "metadata: epoch=1" in capsys.readouterr().out
    assert main(["du", "--json", str(store)]) == 0
    du = json.loads(capsys.readouterr().out)
    assert du["steps"] == 3 and {t["name"] for t in du["tables"]} == {"user", "ids"}
    assert du["dedup_ratio"] > 1.5  # "ids" is shared by all three steps


def test_gc_dry_run_changes_nothing_then_gc_drops(store, capsys):
    assert main(["gc", str(store)]) == 0  # neither option: no step dropped
    assert capsys.readouterr().out.startswith("dropped steps none; kept 10, 20, 30")
    assert main(["gc", str(store), "--keep-last", "1", "--keep", "10", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would drop steps 20; keep 10, 30" in out
    assert ci.list_steps(store)[1].step == 20
    assert main(["gc", str(store), "--keep-last", "1", "--keep", "10", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps_deleted"] == [20] and report["objects_freed"] > 0
    assert [s.step for s in ci.list_steps(store)] == [10, 30]
    assert main(["verify", str(store), "--deep"]) == 0
    assert capsys.readouterr().out.startswith("ok: 2 steps")
    assert main(["gc", str(store), "--keep-last", "1", "--keep", "77"]) == 2
    assert "cannot keep step 77" in capsys.readouterr().err
    assert [s.step for s in ci.list_steps(store)] == [10, 30]


def test_usage_errors_exit_2(store, capsys):
    assert main([]) == 2
    assert main(["show", str(store), "-3"]) == 2
    assert main(["gc", str(store), "--keep-last", "0"]) == 2
    assert main(["frobnicate", str(store)]) == 2
    err = capsys.readouterr().err
    assert "non-negative integer" in err and "positive integer" in err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("ls", "show", "diff", "verify", "repair", "gc", "du", "export", "import",
                "demo"):
        assert cmd in out


def test_export_import_and_verify_step(store, tmp_path, capsys):
    out = tmp_path / "s20.safetensors"
    assert main(["export", str(store), "20", str(out), "--table", "user"]) == 0
    assert "exported step 20 (1 table," in capsys.readouterr().out
    assert main(["export", str(store), "20", str(out)]) == 2  # exists
    assert main(["export", str(store), "20", str(out), "--force"]) == 0
    # One scheme for the file: floating tables take it, "ids" (int64) stays exact.
    assert main(["import", str(store), "40", str(out), "--quant", "fp16"]) == 0
    assert main(["import", str(store), "41", str(out), "--quant", "ids=fp16"]) == 2
    assert "lossy" in capsys.readouterr().err
    assert main(["show", str(store), "40", "--json"]) == 0
    shown = {t["name"]: t["scheme"] for t in json.loads(capsys.readouterr().out)["tables"]}
    assert shown == {"user": "fp16", "ids": "exact"}
    with cnrstore.open(store) as s:
        assert s.steps() == [10, 20, 30, 40]
        a, b = s.get_tables(20), s.get_tables(40)
        assert set(b) == {"user", "ids"}
        assert b["user"].dtype == torch.float32
        assert torch.allclose(a["user"], b["user"], rtol=1e-3, atol=1e-3)
    assert main(["verify", str(store), "--step", "40", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and rep["steps_checked"] == 1


def test_a_lost_pack_is_found_and_named(store, tmp_path, capsys):
    data_pack = max(store.glob("packs/*/*.pack"), key=lambda p: p.stat().st_size)
    data_pack.unlink()
    assert main(["ls", str(store)]) == 0  # sizes come from the index: still listable
    capsys.readouterr()
    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("PROBLEMS FOUND") and "missing" in out
    assert data_pack.name in out
    # diff reads only the patches of step 20, none of which is in step 10's lost pack
    assert main(["diff", str(store), "10", "20"]) == 0
    capsys.readouterr()
    assert main(["export", str(store), "10", str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "lists what is damaged" in err and len(err.strip().splitlines()) == 1


def test_verify_is_deep_by_default_like_the_python_api(store, capsys):
    # Rot in the middle of the largest data pack: only re-hashing payloads finds it.
    data_pack = max(store.glob("packs/*/*.pack"), key=lambda p: p.stat().st_size)
    raw = bytearray(data_pack.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    data_pack.write_bytes(bytes(raw))
    assert main(["verify", str(store), "--shallow"]) == 0
    capsys.readouterr()
    assert main(["verify", str(store)]) == 1
    assert capsys.readouterr().out.startswith("PROBLEMS FOUND")
    with cnrstore.open(store) as s:
        assert not s.verify().ok
    assert not ci.verify(store).ok


def test_repair_rebuilds_a_deleted_index(store, capsys):
    before = [s.step for s in ci.list_steps(store)]
    for f in (store / "index").iterdir():
        f.unlink()
    assert main(["repair", str(store)]) == 0
    assert "roots restored" in capsys.readouterr().out
    assert [s.step for s in ci.list_steps(store)] == before
    assert main(["verify", str(store), "--deep"]) == 0


def test_demo_subcommand_takes_the_demo_options(capsys):
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--steps" in out and "--scheme" in out and "--fail-at" in out
    assert main(["demo", "--steps", "0", "--quiet"]) == 2  # the demo's own validation
    assert "--steps must be >= 1" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_only(store, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert main(["verify", str(store), "--deep"]) == 0
    assert "verify [" in sys.stderr.getvalue()  # drawn, then erased
    assert sys.stderr.getvalue().endswith("\r\033[K")
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert main(["verify", str(store), "--deep", "--no-progress"]) == 0
    assert sys.stderr.getvalue() == ""
    assert capsys.readouterr().out.count("ok: 3 steps") == 2


def test_progress_draws_only_when_enabled():
    stream = io.StringIO()
    with fmt.Progress("verify", enabled=True, stream=stream) as bar:
        bar(5, 10)
        bar(10, 10)
    assert "verify [" in stream.getvalue() and "100.0%" in stream.getvalue()
    assert stream.getvalue().endswith("\r\033[K")
    quiet = io.StringIO()
    with fmt.Progress("verify", enabled=False, stream=quiet) as bar:
        bar(10, 10)
    assert quiet.getvalue() == ""


def test_sizes_and_ranges_read_well():
    assert fmt.size(0) == "0 B" and fmt.size(1536) == "1.50 KiB"
    assert fmt.size(3 * 1024 ** 3) == "3.00 GiB" and fmt.size(200 * 1024 ** 2) == "200 MiB"
    assert fmt.ranges_text([(0, 3), (7, 8)], limit=10) == "0-2, 7"
    assert fmt.ranges_text([(0, 100), (200, 300)], limit=10) == "0-99, ... (200 rows in all)"


def test_rm_and_rollback(store, capsys):
    assert main(["rm", str(store), "20", "99"]) == 2  # all or none: 99 does not exist
    assert "step 99 not found" in capsys.readouterr().err
    with cnrstore.open(store) as s:
        assert s.steps() == [10, 20, 30]
    assert main(["rm", str(store), "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"deleted": [20], "steps": [10, 30]}
    assert main(["rollback", str(store), "20"]) == 2
    assert main(["rollback", str(store), "10"]) == 0
    out = capsys.readouterr().out
    assert "deleted steps: 30" in out and "cnrstore gc" in out
    with cnrstore.open(store) as s:
        assert s.steps() == [10]
        assert s.verify().ok
    assert main(["rollback", str(store), "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"deleted": [], "steps": [10]}


def test_show_lists_the_python_values_of_a_put_state_step(tmp_path, capsys):
    path = tmp_path / "s"
    with cnrstore.open(path) as s:
        s.put_state(1, {"model": {"w": torch.zeros(4, 2)}, "epoch": 3,
                        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}})
    assert main(["show", str(path), "1"]) == 0
    out = capsys.readouterr().out
    assert "state: epoch=3, optim/param_groups/0/lr=0.1" in out and "model/w" in out
    assert main(["show", str(path), "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"]["optim/param_groups/0/betas/1"] == 0.99


# -- a store on a shared directory (index in a local cache) --------------------------------

def test_shared_directory_store_needs_and_takes_a_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CNRSTORE_CACHE_DIR", raising=False)
    shared = tmp_path / "shared"
    user = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    with cnrstore.open(shared, cache_dir=tmp_path / "writer", block_rows=16) as s:
        s.put_tables(1, {"user": user})
        s.put_tables(2, {"user": user + 1})
    assert main(["ls", str(shared)]) == 2
    assert "--cache-dir" in capsys.readouterr().err
    assert main(["repair", str(shared)]) == 2
    capsys.readouterr()
    assert main(["ls", str(shared), "--cache-dir", str(tmp_path / "c1"), "--json"]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)] == [1, 2]
    monkeypatch.setenv("CNRSTORE_CACHE_DIR", str(tmp_path / "c2"))
    assert main(["rm", str(shared), "1"]) == 0
    capsys.readouterr()
    assert main(["verify", str(shared), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    with cnrstore.open(shared, cache_dir=tmp_path / "writer") as s:  # a stale cache
        assert s.steps() == [2]
        assert torch.equal(s.get_tables(2)["user"], user + 1)


def test_cache_variable_never_applies_to_a_directory_store(store, tmp_path, capsys,
                                                           monkeypatch):
    monkeypatch.setenv("CNRSTORE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["ls", str(store), "--json"]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)] == [10, 20, 30]
    assert not (tmp_path / "cache").exists()
    # An explicit --cache-dir on a directory store is refused (the engine says why).
    assert main(["ls", str(store), "--cache-dir", str(tmp_path / "cache")]) != 0
    assert capsys.readouterr().err.strip()

"""The ``cnrstore`` command on a store in a bucket (moto's S3 server on 127.0.0.1).

The bucket is configured the way a user configures it: the AWS_* environment variables,
and the index cache in ``--cache-dir`` (or $CNRSTORE_CACHE_DIR). Every command below runs
on a cache other than the one the store was written through, so each also shows that a
cache catches up with the bucket before it answers.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import torch  # noqa: E402

import cnrstore  # noqa: E402
from cnrstore.cli.app import main  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server():
    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from _s3 import MotoS3

    s3 = MotoS3()
    yield s3
    s3.stop()


@pytest.fixture
def aws(server, monkeypatch):
    env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("CNRSTORE_CACHE_DIR", raising=False)
    return env


@pytest.fixture
def bucket_store(server, aws, tmp_path):
    url = server.url()
    user = torch.randn(120, 8, generator=torch.Generator().manual_seed(1))
    with cnrstore.open(url, cache_dir=tmp_path / "writer-cache", block_rows=16,
                       fanout=4) as s:
        s.put_tables(1, {"user": user}, metadata={"epoch": 1})
        user[[3, 70]] += 1
        s.put_tables(2, {"user": user}, quant={"user": "int8"})
    return url, user


def _json(argv: list[str], capsys) -> tuple[int, object]:
    capsys.readouterr()
    code = main(argv + ["--json"])
    out = capsys.readouterr().out
    return code, (json.loads(out) if out.strip() else None)


def test_view_commands_read_the_bucket_through_a_fresh_cache(bucket_store, tmp_path, capsys):
    url, _ = bucket_store
    cache = str(tmp_path / "cli-cache")
    code, steps = _json(["ls", url, "--cache-dir", cache], capsys)
    assert code == 0
    assert [s["step"] for s in steps] == [1, 2]
    code, detail = _json(["show", url, "2", "--cache-dir", cache], capsys)
    assert code == 0 and "user" in json.dumps(detail)
    code, report = _json(["verify", url, "--cache-dir", cache], capsys)
    assert code == 0 and report["ok"]
    code, _ = _json(["du", url, "--cache-dir", cache], capsys)
    assert code == 0


def test_rm_through_one_cache_is_seen_through_another(bucket_store, tmp_path, capsys,
                                                      monkeypatch):
    url, user = bucket_store
    monkeypatch.setenv("CNRSTORE_CACHE_DIR", str(tmp_path / "env-cache"))
    assert main(["rm", url, "1"]) == 0
    code, steps = _json(["ls", url, "--cache-dir", str(tmp_path / "other")], capsys)
    assert code == 0 and [s["step"] for s in steps] == [2]
    # The writer's own (now stale) cache catches up on open and restores what is left.
    with cnrstore.open(url, cache_dir=tmp_path / "writer-cache") as s:
        assert s.steps() == [2]
        got = s.get_tables(2)["user"]
    assert torch.allclose(got, user, atol=0.05)


def test_export_and_import_through_the_bucket(bucket_store, tmp_path, capsys):
    pytest.importorskip("safetensors")
    url, user = bucket_store
    cache = str(tmp_path / "c")
    out = tmp_path / "two.safetensors"
    assert main(["export", url, "1", str(out), "--cache-dir", cache]) == 0
    assert main(["import", url, "3", str(out), "--cache-dir", cache]) == 0
    with cnrstore.open(url, cache_dir=tmp_path / "check") as s:
        assert s.steps() == [1, 2, 3]
        assert torch.equal(s.get_tables(3)["user"], s.get_tables(1)["user"])


def test_bucket_usage_errors_exit_2(aws, server, tmp_path, capsys):
    url = server.url()
    # No cache directory: said before anything is opened.
    assert main(["ls", url]) == 2
    assert "--cache-dir" in capsys.readouterr().err
    # No store under that prefix: nothing is created by a read-only command.
    assert main(["ls", url, "--cache-dir", str(tmp_path / "c")]) != 0
    assert "no store" in capsys.readouterr().err
    assert main(["repair", url, "--cache-dir", str(tmp_path / "c")]) != 0
    assert "no store" in capsys.readouterr().err


def test_ls_on_a_bucket_does_not_import_torch(bucket_store, aws, tmp_path):
    url, _ = bucket_store
    probe = ("import json, sys\nfrom cnrstore.cli.app import main\n"
             "code = main(sys.argv[1:])\n"
             "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **aws)
    proc = subprocess.run([sys.executable, "-c", probe, "ls", url, "--cache-dir",
                           str(tmp_path / "probe"), "--json"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc == {"code": 0, "torch": False}, proc.stderr


def test_help_names_the_cache_option():
    out = subprocess.run([sys.executable, "-m", "cnrstore.cli.app", "ls", "--help"],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT).stdout
    assert "--cache-dir" in out and "s3://" in out


def test_a_missing_bucket_is_named(aws, server, tmp_path, capsys):
    url = "s3://no-such-bucket-here/store"
    assert main(["ls", url, "--cache-dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "bucket 'no-such-bucket-here' does not exist" in err
    assert "Generic S3 error" not in err and len(err.strip().splitlines()) == 1


def test_gc_on_a_bucket_says_the_grace_period_holds_the_packs(bucket_store, tmp_path,
                                                              capsys):
    url, _ = bucket_store
    cache = str(tmp_path / "gc-cache")
    assert main(["rm", url, "1", "--cache-dir", cache]) == 0
    capsys.readouterr()
    assert main(["gc", url, "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "0 B on disk" in out  # the default grace (6 h) keeps every retired pack
    assert "gc grace period (gc_grace_s, 6 h after this gc)" in out
    assert re.search(r"\n\d+ packs? \([\d.]+ [KMG]?i?B\) no longer needed", out), out
    code, done = _json(["gc", url, "--cache-dir", cache], capsys)
    assert code == 0 and done["packs_held"] >= 1 and done["bytes_held"] > 0
    assert done["grace_s"] == 21600.0

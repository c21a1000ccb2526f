"""What the ``cnrstore`` command imports (issue 14): ``--help`` and the read-only commands
start without torch, because importing torch costs more than a second and the commands
that only read the index and the msgpack manifests do not need it.

Each command runs in a fresh interpreter that calls the CLI's ``main`` and then prints the
modules it loaded; the store is made beforehand in this process.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import cnrstore

ROOT = pathlib.Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
from cnrstore.cli.app import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
print("\\n" + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _modules(*args: str) -> tuple[int, set[str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc["code"], set(doc["modules"])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("imports") / "store"
    user = torch.randn(100, 8, generator=torch.Generator().manual_seed(0))
    with cnrstore.open(path, block_rows=16, fanout=4) as s:
        s.put_tables(1, {"user": user, "ids": torch.arange(20)}, metadata={"epoch": 1})
        user[[3, 50]] += 1
        s.put_tables(2, {"user": user}, quant={"user": "int4"})
        s.put_state(3, {"model": {"w": user}, "epoch": 2})
    return path


def test_help_imports_neither_torch_nor_numpy():
    code, modules = _modules("--help")
    assert code == 0
    assert "torch" not in modules and "numpy" not in modules
    assert "cnrstore.core.store" not in modules


@pytest.mark.parametrize(("command", "rest"), [
    ("ls", []), ("show", ["2"]), ("show", ["3"]), ("du", []), ("diff", ["1", "2"]),
    ("verify", ["--shallow"]), ("verify", []), ("verify", ["--step", "2"]),
    ("show", ["99"]),  # an error path too
    ("gc", ["--dry-run"]), ("gc", ["--keep-last", "1", "--dry-run"]), ("show", ["latest"]),
])
def test_read_only_commands_do_not_import_torch(store, command, rest):
    code, modules = _modules(command, str(store), *rest, "--json")
    assert code == (2 if rest == ["99"] else 0)
    assert "torch" not in modules
    assert "cnrstore.core.store" not in modules


def test_import_cnrstore_is_lazy_but_complete():
    probe = ("import sys, cnrstore; assert 'torch' not in sys.modules; "
             "names = set(dir(cnrstore)); assert set(cnrstore.__all__) <= names; "
             "from cnrstore import open, CheckpointStore, StepInfo, SCHEMES; "
             "assert 'torch' in sys.modules and cnrstore.open is open; print('ok')")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr
    with pytest.raises(AttributeError):
        cnrstore.no_such_name  # noqa: B018

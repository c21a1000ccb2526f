"""The checkpoint layer's packages import only packages below them, and no two modules
import each other (directly or around a cycle), so each layer can be read and tested from
the bottom up (docs/ARCHITECTURE.md, "Layers"). Every module of cnrstore/ is checked,
imports inside functions included: they run too."""

from __future__ import annotations

import pathlib

import _importgraph as ig
import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "cnrstore"

# Lowest first. A module may import its own package and the packages ranked below it.
RANK = {
    "errors": 0,
    "codec": 1,
    "format": 2,
    "core": 3,
    "tools": 4,
    "distributed": 4,  # many ranks: the store over torch.distributed
    "dcp": 5,        # torch.distributed.checkpoint storage over the (distributed) store
    "demo": 5,       # an application: the public facade and the tools (progress, sizes)
    "cli": 6,
    "__init__": 7,   # the public facade
    "__main__": 8,
}


def _imports(path: pathlib.Path, me: str | None = None) -> set[str]:
    """cnrstore modules (dotted) that `path` (module `me`) imports anywhere in its body."""
    found = ig.imports(path, me or ig.module_name(path), ["cnrstore"])
    return {ig.resolve(name, _modules()) or name for name in found}


def _modules() -> dict[str, pathlib.Path]:
    return ig.modules(["cnrstore"])


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _graph() -> dict[str, set[str]]:
    return ig.graph(["cnrstore"])


def test_every_module_belongs_to_a_ranked_layer():
    for name in _modules():
        assert _layer(name) in RANK, f"{name}: not in a layer of tests/cnrstore/test_layers.py"


def test_packages_import_only_lower_layers():
    graph = _graph()
    assert sum(len(deps) for deps in graph.values()) > 50
    # The demo is written as a user would write it, against the public facade; inside the
    # package the facade would pull in every layer.
    assert ig.against_stack(graph, _layer, RANK, may_use_facade=["demo"]) == []


def test_no_import_cycles():
    cycles = ig.cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_relative_absolute_and_function_level_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from .store import x\nfrom . import writer\nimport cnrstore.format.blocks\n"
                     "def f():\n    from ..codec import quantize\n")
    found = _imports(probe, "cnrstore.core.probe")
    for name in ("cnrstore.core.store", "cnrstore.core.writer", "cnrstore.format.blocks",
                 "cnrstore.codec.quantize"):
        assert name in found, (name, found)


def test_the_cycle_check_sees_a_cycle(monkeypatch):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    monkeypatch.setitem(globals(), "_graph", lambda: graph)
    try:
        test_no_import_cycles()
    except AssertionError as exc:
        assert "['a', 'b', 'c']" in str(exc)
    else:
        raise AssertionError("a cycle went unseen")


@pytest.mark.slow  # a cold mypy run over cnrstore takes ~30 s; the engine's runs by default
def test_the_type_checker_passes_on_the_checkpoint_layer(tmp_path):
    # mypy is in the test extra (CI installs it); configured in pyproject.toml [tool.mypy].
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mypy", "cnrstore", "--cache-dir",
                           str(tmp_path / "cache")], cwd=PKG.parent, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr

"""The checkpoint layer's modules import only modules below them (STYLE.md: no module
imports one above it), so each can be read and tested from the bottom up."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "cnrstore"

# Lowest first. The codec modules (C1) form the bottom layer with the error tree.
ORDER = [
    {"errors", "bitpack", "qparams", "qsearch", "fingerprint", "quantize", "quantspec",
     "state", "options"},
    {"blocks"},
    {"manifest"},
    {"tablestate", "validate", "retention"},
    {"snapshot", "restore"},
    {"writer", "seed"},
    {"maintenance"},
    {"lineage", "statestore"},
    {"stateapi"},
    {"store"},
]
RANK = {name: i for i, layer in enumerate(ORDER) for name in layer}


def _local_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
            elif node.level == 0 and node.module and node.module.startswith("cnrstore."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cnrstore."):
                    found.add(alias.name.split(".")[1])
    return found


def test_core_modules_import_only_lower_layers():
    checked = 0
    for name, rank in RANK.items():
        path = PKG / f"{name}.py"
        if not path.exists():
            continue
        checked += 1
        for dep in _local_imports(path):
            assert dep in RANK, f"cnrstore/{name}.py imports cnrstore.{dep}, outside the core"
            if rank == 0:  # the bottom layer's modules may use each other
                assert RANK[dep] == 0, f"cnrstore/{name}.py imports cnrstore.{dep} (above it)"
            else:
                assert RANK[dep] < rank, f"cnrstore/{name}.py imports cnrstore.{dep} (not below)"
    assert checked >= 10


def test_the_checker_sees_relative_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from .store import x\nfrom . import writer\nimport cnrstore.blocks\n")
    assert _local_imports(probe) == {"store", "writer", "blocks"}

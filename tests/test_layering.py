"""engine/ is bytes-only: it must never import torch, numpy or cnrstore (DESIGN.md)."""

import ast
import pathlib
import subprocess
import sys

ENGINE = pathlib.Path(__file__).resolve().parents[1] / "engine"
FORBIDDEN = {"torch", "numpy", "cnrstore"}


def _imported_roots(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_engine_sources_do_not_import_tensor_libraries():
    files = sorted(ENGINE.rglob("*.py"))
    assert files, "engine/ has no sources"
    for path in files:
        bad = _imported_roots(path) & FORBIDDEN
        assert not bad, f"{path.relative_to(ENGINE.parent)} imports {sorted(bad)}"


def test_importing_engine_loads_no_tensor_library():
    code = (
        "import sys, engine, importlib, pkgutil\n"
        "for m in pkgutil.walk_packages(engine.__path__, 'engine.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(set(sys.modules) & {'torch', 'numpy', 'cnrstore'})\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""engine/ is bytes-only: it must never import torch, numpy or cnrstore (docs/ARCHITECTURE.md,
"Layer rules")."""

import ast
import pathlib
import subprocess
import sys

import _importgraph as ig
import pytest

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


def _over_400_lines(root: pathlib.Path) -> dict[str, int]:
    """Modules under ``root`` (every folder) longer than the house rule's 400 lines."""
    return {str(p.relative_to(root)): n for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400}


@pytest.mark.parametrize("package", ["engine", "cnrstore"])
def test_no_module_is_over_400_lines(package):
    long = _over_400_lines(ENGINE.parent / package)
    assert long == {}, f"{package} modules over 400 lines (split them): " + ", ".join(
        f"{name} ({n})" for name, n in long.items())


def test_the_length_check_looks_into_subpackages(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 401)
    (tmp_path / "short.py").write_text("x = 1\n" * 400)
    assert _over_400_lines(tmp_path) == {str(pathlib.Path("sub", "long.py")): 401}


# -- no import cycle anywhere in the repository ------------------------------------------
PACKAGES = ["engine", "cnrstore"]


def test_no_import_cycle_in_the_repository():
    # Both packages in one graph, imports inside functions and under TYPE_CHECKING
    # counted (tests/_importgraph.py): a cycle through the two would show here only.
    graph = ig.graph(PACKAGES)
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)
    assert any(dep.startswith("engine") for name, deps in graph.items()
               if name.startswith("cnrstore") for dep in deps)
    cycles = ig.cycles(graph)
    assert cycles == [], f"{len(cycles)} import cycles: {cycles}"


def test_the_cycle_check_sees_a_cycle_across_packages_and_inside_functions(tmp_path):
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "engine" / "a.py").write_text("def f():\n    import cnrstore.b\n")
    (tmp_path / "cnrstore" / "b.py").write_text("from engine import a\n")
    (tmp_path / "cnrstore" / "c.py").write_text("from . import b\n")
    graph = ig.graph(PACKAGES, root=tmp_path)
    assert ig.cycles(graph) == [["cnrstore.b", "engine.a"]]
    assert ig.cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert ig.cycles({"x": {"y"}, "y": set()}) == []

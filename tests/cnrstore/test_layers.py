"""The checkpoint layer's packages import only packages below them, and no two modules
import each other (directly or around a cycle), so each layer can be read and tested from
the bottom up (docs/ARCHITECTURE.md, "Layers"). Every module of cnrstore/ is checked,
imports inside functions included: they run too."""

from __future__ import annotations

import ast
import pathlib

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


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, me: str | None = None) -> set[str]:
    """cnrstore modules (dotted) that `path` (module `me`) imports anywhere in its body."""
    me = me or _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod == "cnrstore" or mod.startswith("cnrstore."):
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cnrstore"))
    return found


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = {_resolve(d, modules) for d in _imports(path)}
        graph[name] = {d for d in deps if d and d != name}
    return graph


def test_every_module_belongs_to_a_ranked_layer():
    for name in _modules():
        assert _layer(name) in RANK, f"{name}: not in a layer of tests/cnrstore/test_layers.py"


def test_packages_import_only_lower_layers():
    graph = _graph()
    checked = 0
    for name, deps in graph.items():
        for dep in deps:
            checked += 1
            mine, theirs = _layer(name), _layer(dep)
            if theirs == "__init__" and mine != "__init__":
                # The demo is written as a user would write it, against the public facade;
                # inside the package the facade would pull in every layer.
                assert mine == "demo", f"{name} imports the cnrstore facade; import the module"
                continue
            assert RANK[theirs] < RANK[mine] or theirs == mine, (
                f"{name} ({mine}) imports {dep} ({theirs}), a layer not below it")
    assert checked > 50


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
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


def test_the_type_checker_passes_on_the_checkpoint_layer(tmp_path):
    # mypy is in the test extra (CI installs it); configured in pyproject.toml [tool.mypy].
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mypy", "cnrstore", "--cache-dir",
                           str(tmp_path / "cache")], cwd=PKG.parent, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr

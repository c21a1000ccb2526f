"""The import graph of the repository's packages, read from their sources (the AST, so
imports inside functions and under TYPE_CHECKING count: they run too, or the type checker
follows them), and the two checks every layer test runs on it: no import against the
stack of layers, no cycle. tests/cnrstore/test_layers.py, tests/engine/test_layers.py and
tests/test_layering.py share this one implementation."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable, Iterable, Mapping

REPO = pathlib.Path(__file__).resolve().parents[1]


def module_name(path: pathlib.Path, root: pathlib.Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: pathlib.Path, me: str, packages: Iterable[str]) -> set[str]:
    """Dotted names that ``path`` (module ``me``) imports from ``packages``, anywhere in its
    body. ``from pkg import name`` yields ``pkg.name``: the module ``name`` when there is
    one, else (``resolve`` walks up) ``pkg`` itself, whose ``__init__`` defines it."""
    tops = set(packages)
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
            if mod.split(".")[0] in tops:
                found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in tops)
    return found


def modules(packages: Iterable[str], root: pathlib.Path = REPO) -> dict[str, pathlib.Path]:
    return {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}


def resolve(name: str, known: Mapping[str, pathlib.Path]) -> str | None:
    """The module ``name`` lives in: itself, or the nearest package above it."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def graph(packages: Iterable[str], root: pathlib.Path = REPO) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (itself left out)."""
    packages = tuple(packages)
    known = modules(packages, root)
    out = {}
    for name, path in known.items():
        deps = {resolve(d, known) for d in imports(path, name, packages)}
        out[name] = {d for d in deps if d and d != name}
    return out


def cycles(g: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm),
    each sorted; a self-import is not counted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(found)


def against_stack(g: Mapping[str, Iterable[str]], layer: Callable[[str], str],
                  rank: Mapping[str, int], *, facade: str = "__init__",
                  may_use_facade: Iterable[str] = ()) -> list[str]:
    """Imports of a layer not below the importer's own (a module may import its own layer
    and the layers ranked below it), and imports of the package facade from inside the
    package (except by the layers in ``may_use_facade``), each as a sentence."""
    allowed = set(may_use_facade)
    bad = []
    for name, deps in sorted(g.items()):
        mine = layer(name)
        for dep in sorted(deps):
            theirs = layer(dep)
            if theirs == facade and mine != facade:
                if mine not in allowed:
                    bad.append(f"{name} imports the package facade; import the module")
            elif theirs != mine and not rank[theirs] < rank[mine]:
                bad.append(f"{name} ({mine}) imports {dep} ({theirs}), a layer not below it")
    return bad

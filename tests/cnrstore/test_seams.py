"""Seams instead of reach-ins (issue 9): no module but core/store.py touches a private
field or method of a CheckpointStore; the modules that do the store's work receive its
HandleState. An AST scan of every module of cnrstore/, so a new reach-in fails here."""

from __future__ import annotations

import ast
import pathlib

import cnrstore
import engine
from cnrstore.core.store import CheckpointStore

PKG = pathlib.Path(cnrstore.__file__).resolve().parent
STORE = PKG / "core" / "store.py"


def _private_names() -> set[str]:
    with CheckpointStore(engine.MemoryStore()) as s:
        names = set(vars(s))
    names |= {n for c in CheckpointStore.__mro__ if c is not object for n in vars(c)}
    return {n for n in names if n.startswith("_") and not n.endswith("__")}


def _reach_ins(path: pathlib.Path, private: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in private:
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in private):
            name = node.args[1].value
        if name is not None:
            found.append(f"{path}:{node.lineno}: {name}")
    return found


def test_only_store_py_touches_the_store_private_fields():
    private = _private_names()
    assert "_core" in private  # the scan sees the handle's real fields
    found = [hit for p in sorted(PKG.rglob("*.py")) if p != STORE
             for hit in _reach_ins(p, private)]
    assert not found, "reach-ins into CheckpointStore:\n" + "\n".join(found)


def test_the_scan_finds_a_reach_in(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text("def f(store):\n    return store._core.objects, getattr(store, '_core')\n")
    assert len(_reach_ins(bad, _private_names())) == 2


def test_core_store_py_stays_short():
    assert len(STORE.read_text().splitlines()) <= 400

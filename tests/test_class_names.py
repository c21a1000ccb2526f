"""One name, one class, across cnrstore/ and engine/ and inside each (issue 24: two classes
were named StoreCore, one per package, and two PackSinks inside the engine, so a name in a
traceback or a doc named either). cnrstore translates the engine's reports and errors at its
boundary; the engine's own are named for their layer (StoreGCReport, CommitSequenceTaken).
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

def class_names(package: pathlib.Path) -> dict[str, list[str]]:
    """Every class defined anywhere under ``package`` (nested ones too) -> where."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def shared_names(a: pathlib.Path, b: pathlib.Path) -> dict[str, list[str]]:
    """Class names defined in both trees, with every place each is defined."""
    ca, cb = class_names(a), class_names(b)
    return {n: ca[n] + cb[n] for n in sorted(set(ca) & set(cb))}


def test_no_class_name_is_shared_by_cnrstore_and_engine():
    shared = shared_names(ROOT / "cnrstore", ROOT / "engine")
    assert not shared, f"classes of the same name in cnrstore/ and engine/: {shared}"


@pytest.mark.parametrize("package", ["cnrstore", "engine"])
def test_every_class_name_of_a_package_is_unique(package):
    dup = {n: w for n, w in class_names(ROOT / package).items() if len(w) > 1}
    assert not dup, f"classes of the same name inside {package}/: {dup}"


@pytest.fixture
def probe_tree(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Two small packages, one class name in both (a nested class, in a subfolder)."""
    a, b = tmp_path / "cnrstore", tmp_path / "engine" / "deep"
    a.mkdir()
    b.mkdir(parents=True)
    (a / "handle.py").write_text("class StoreCore:\n    pass\n")
    (b / "core.py").write_text("def f():\n    class StoreCore:\n        pass\n")
    return a, tmp_path / "engine"


def test_the_check_finds_a_shared_name_on_a_probe(probe_tree):
    a, b = probe_tree
    shared = shared_names(a, b)
    assert list(shared) == ["StoreCore"]
    assert len(shared["StoreCore"]) == 2


def test_the_check_finds_a_duplicate_inside_a_package(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.py").write_text("class Sink:\n    pass\n")
    (tmp_path / "b.py").write_text("class Sink:\n    pass\nclass Other:\n    pass\n")
    dup = {n: w for n, w in class_names(tmp_path).items() if len(w) > 1}
    assert list(dup) == ["Sink"] and len(dup["Sink"]) == 2

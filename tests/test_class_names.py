"""One name, one class, across cnrstore/ and engine/ (issue 24: two classes were named
StoreCore, one per package, so "StoreCore" in a traceback or a doc named either).

The only names both packages may share are those both export as public API, where
cnrstore's class is the engine's under the same name one layer up (an engine error
translated into cnrstore's tree, a report wrapping the engine's report): renaming either
would break its users. The list is explicit, and a stale entry fails too.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# cnrstore's public face of the engine's public class of the same name.
MIRRORED = {"ConcurrentCommit", "GCReport", "OptionsMismatch", "VerifyReport"}


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
    clashes = {n: w for n, w in shared.items() if n not in MIRRORED}
    assert not clashes, f"classes of the same name in cnrstore/ and engine/: {clashes}"


def test_every_class_name_of_cnrstore_is_unique():
    dup = {n: w for n, w in class_names(ROOT / "cnrstore").items() if len(w) > 1}
    assert not dup, f"classes of the same name inside cnrstore/: {dup}"


def test_mirrored_names_are_public_in_both_and_still_shared():
    import cnrstore
    import engine

    shared = shared_names(ROOT / "cnrstore", ROOT / "engine")
    assert MIRRORED <= set(shared), f"stale entries: {sorted(MIRRORED - set(shared))}"
    for name in MIRRORED:
        assert name in cnrstore.__all__ and name in engine.__all__, name


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

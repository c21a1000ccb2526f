"""The engine's internal seams (issue 9): no module reaches into another object's private
fields, one DAG walk serves gc, verify, repair and the twin, options are read back on
open, and the engine type-checks."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.errors import EngineOptionsMismatch, StoreError
from engine.format import options as eo
from engine.store.repairroots import lost_under
from engine.store.walk import walk

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"

# Private attributes touched through something other than ``self``, each a companion in
# the module that defines the field: index.py's process-wide registry of shared Index
# handles, and the twin's writer, which is part of the twin store.
ALLOWED = {
    ("index/db.py", "index._users"),
    ("index/db.py", "index._shared_key"),
    ("index/db.py", "_SHARED.pop(stale)._close_inherited"),
    ("store/memory.py", "self._store._lock"),
    ("store/memory.py", "self._store._roots"),
    ("store/memory.py", "self._store._objects"),
}


def private_reach_ins(folder: pathlib.Path) -> list[str]:
    """``obj._name`` of every module under ``folder`` (subpackages too) where ``obj`` is
    not self or cls."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        name = path.relative_to(folder).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            if not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            text = ast.unparse(node)
            if (name, text) not in ALLOWED:
                found.append(f"{name}:{node.lineno}: {text}")
    return found


def test_no_module_reaches_into_private_fields():
    assert private_reach_ins(ENGINE) == []


def test_the_private_field_check_looks_into_subpackages(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.py").write_text("def f(other):\n    return other._secret\n")
    (tmp_path / "top.py").write_text("def g(self):\n    return self._mine\n")
    assert private_reach_ins(tmp_path) == ["sub/deep.py:2: other._secret"]


def test_the_type_checker_passes_on_the_engine(tmp_path):
    pytest.importorskip("mypy")
    # Configured in pyproject.toml ([tool.mypy]); the cache stays out of the tree.
    done = subprocess.run([sys.executable, "-m", "mypy", "engine", "--cache-dir",
                           str(tmp_path / "cache")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


# -- the one walk ---------------------------------------------------------------------
def _graphs():
    """A DAG over ids 0..n-1 (refs only to lower ids, so it is acyclic), some ids removed
    (missing objects), and root picks."""
    return st.integers(1, 30).flatmap(lambda n: st.tuples(
        st.just(n),
        st.lists(st.lists(st.integers(0, n - 1), max_size=4), min_size=n, max_size=n),
        st.sets(st.integers(0, n - 1)),
        st.lists(st.integers(0, n - 1), min_size=1, max_size=4),
    ))


@settings(max_examples=200, deadline=None)
@given(_graphs())
def test_walk_finds_what_is_reachable_and_asks_each_id_once(graph):
    n, refs, missing, roots = graph
    oid = [i.to_bytes(16, "big") for i in range(n)]
    objects = {oid[i]: tuple(oid[r] for r in refs[i] if r < i) for i in range(n)
               if i not in missing}
    asked = []

    def refs_of(o, via):
        asked.append(o)
        return objects.get(o)

    found = walk(((oid[r], f"r{r}") for r in roots), refs_of)
    # Reference: plain recursion over the same graph.
    expect: set[bytes] = set()
    reached: set[bytes] = set()

    def visit(o):
        if o in reached:
            return
        reached.add(o)
        if o in objects:
            expect.add(o)
            for r in objects[o]:
                visit(r)

    for r in roots:
        visit(oid[r])
    assert found == expect
    assert sorted(asked) == sorted(reached)  # each id once, missing ones too


def test_walk_survives_a_chain_deeper_than_the_recursion_limit():
    depth = sys.getrecursionlimit() * 3
    ids = [i.to_bytes(16, "big") for i in range(depth)]
    refs = {ids[i]: (ids[i + 1],) if i + 1 < depth else () for i in range(depth)}
    assert len(walk([(ids[0], "deep")], lambda o, via: refs[o])) == depth


def test_walk_reports_how_a_missing_object_was_reached():
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    seen = []

    def refs_of(o, via):
        if o == c:
            seen.append(via)
            return None
        return {a: (b,), b: (c,)}[o]

    assert walk([(a, "main")], refs_of) == {a, b}
    assert seen == [b]  # the parent's id, not the root's name


def test_repair_completeness_uses_the_walk():
    store = engine.MemoryStore()
    with store.writer() as w:
        leaf = w.put(1, b"leaf")
        top = w.put(2, b"top", [leaf])
    entries = {leaf: _Entry(()), top: _Entry((leaf,))}
    assert lost_under(entries, [top]) == set()
    del entries[leaf]
    assert lost_under(entries, [top]) == {leaf}
    assert lost_under(entries, []) == set()


class _Entry:
    def __init__(self, refs):
        self.refs = refs


# -- options --------------------------------------------------------------------------
def test_tuning_options_are_read_back_when_not_given(tmp_path):
    with engine.open(tmp_path / "s", compression_level=9, pack_target_size=1 << 20) as s:
        assert s.compression_level == 9
    with engine.open(tmp_path / "s") as s:
        assert (s.compression_level, s.pack_target_size) == (9, 1 << 20)
        assert s.options.map_size == eo.DEFAULTS["map_size"]
    # Tuning may differ from what the store was created with: this open writes at 1.
    with engine.open(tmp_path / "s", compression_level=1) as s:
        assert s.compression_level == 1
        with s.writer() as w:
            w.set_root("r", w.put(1, b"x" * 1000))
    with engine.open(tmp_path / "s", readonly=True) as s:
        assert s.compression_level == 9  # the stored map is the creation's, not the last's
        assert s.get(s.root("r")).payload == b"x" * 1000


def test_repair_keeps_the_stored_options(tmp_path):
    with engine.open(tmp_path / "s", compression_level=7) as s:
        with s.writer() as w:
            w.set_root("r", w.put(1, b"x"))
    with engine.open(tmp_path / "s", compression_level=2) as s:
        s.repair()
    with engine.open(tmp_path / "s") as s:
        assert s.compression_level == 7


def test_a_lost_index_takes_the_rebuilding_handles_options(tmp_path):
    with engine.open(tmp_path / "s", compression_level=7) as s:
        with s.writer() as w:
            w.set_root("r", w.put(1, b"x"))
    shutil.rmtree(tmp_path / "s" / "index")  # derived data: nothing else knew the 7
    with engine.open(tmp_path / "s", compression_level=4) as s:
        assert s.opened_with_repair is not None
    with engine.open(tmp_path / "s") as s:
        assert s.compression_level == 4


def test_invalid_options_are_refused_before_the_store_is_touched(tmp_path):
    with pytest.raises(ValueError):
        engine.open(tmp_path / "s", compression_level=99)
    assert not (tmp_path / "s").exists()


def test_a_conflicting_data_option_raises_options_mismatch():
    # The engine has no data option today (engine/format/options.py); the rule is the same for
    # any that a later format version adds.
    assert eo.DATA_OPTIONS == frozenset()
    stored = {"compression_level": 5}
    data = frozenset({"compression_level"})
    with pytest.raises(EngineOptionsMismatch) as info:
        eo.resolve({"compression_level": 6}, stored, data_options=data)
    assert isinstance(info.value, StoreError)
    assert (info.value.name, info.value.stored, info.value.asked) == ("compression_level",
                                                                     5, 6)
    assert "describes data already stored" in str(info.value)
    # Not asking, or asking for the stored value, is fine.
    assert eo.resolve({}, stored, data_options=data).compression_level == 5
    assert eo.resolve({"compression_level": 5}, stored, data_options=data).compression_level == 5


@pytest.mark.parametrize("stored", [None, {}, {"compression_level": "9"},
                                    {"compression_level": 99}, {"future_option": 1}])
def test_unusable_or_unknown_stored_values_fall_back_to_defaults(stored):
    assert eo.resolve({}, stored) == eo.EngineOptions()

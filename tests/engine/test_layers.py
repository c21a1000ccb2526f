"""The engine's subpackages draw its stack (docs/ARCHITECTURE.md, "The engine"): each
imports only the layers ranked below it, and the storage backends know keys and bytes,
nothing of packs, the index or the stores. Every module of engine/ is checked, imports
inside functions and under TYPE_CHECKING included (tests/_importgraph.py)."""

from __future__ import annotations

import _importgraph as ig

# Lowest first. A module may import its own layer and the layers ranked below it.
RANK = {
    "errors": 0,     # engine/errors.py: the one exception tree
    "format": 1,     # byte layouts: ids, records, roots, trailers, names of packs, commit docs
    "fs": 1,         # durable file writes, writeback hints, the writer lock, crash points
    "api": 2,        # engine/api.py: the ObjectStore contract and its reports
    "storage": 3,    # where bytes live, by key: a directory, a shared one, a bucket, memory
    "packs": 4,      # pack files: append, seal, read, scan
    "index": 5,      # the LMDB index: schema, checks, applying a commit document
    "store": 6,      # PackStore, writer, gc, verify, repair, adoption, commit logs, the twin
    "testing": 7,    # engine/testing: the suites a new backend or store runs
    "__init__": 8,   # the public facade
}
# Keys and bytes only: not even format/ (pack names, trailers, records are packs/' business).
STORAGE_MAY_USE = {"errors", "fs", "storage"}


def _layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _storage_reaches_up(graph: dict[str, set[str]]) -> list[str]:
    return [f"{name} imports {dep}" for name, deps in sorted(graph.items())
            if _layer(name) == "storage" for dep in sorted(deps)
            if _layer(dep) not in STORAGE_MAY_USE]


def test_every_module_belongs_to_a_ranked_layer():
    for name in ig.modules(["engine"]):
        assert _layer(name) in RANK, f"{name}: not in a layer of tests/engine/test_layers.py"


def test_layers_import_only_layers_below_them():
    graph = ig.graph(["engine"])
    assert sum(len(deps) for deps in graph.values()) > 150
    assert ig.against_stack(graph, _layer, RANK) == []


def test_storage_imports_nothing_of_packs_index_or_store():
    graph = ig.graph(["engine"])
    assert any(_layer(n) == "storage" and deps for n, deps in graph.items())
    assert _storage_reaches_up(graph) == []


def test_the_engine_has_no_import_cycle():
    assert ig.cycles(ig.graph(["engine"])) == []


# -- the checks fail on what they must refuse ------------------------------------------
def test_the_stack_check_refuses_an_import_from_above_and_of_the_facade():
    graph = {
        "engine.storage.local": {"engine.packs.pack", "engine.format.names"},
        "engine.packs.pack": {"engine.storage.base"},
        "engine.index.db": {"engine.store.core"},
        "engine.store.gc": {"engine"},
        "engine.format.ids": {"engine.fs.lock"},  # two layers of one rank
        "engine": {"engine.store.packstore"},
    }
    assert ig.against_stack(graph, _layer, RANK) == [
        "engine.format.ids (format) imports engine.fs.lock (fs), a layer not below it",
        "engine.index.db (index) imports engine.store.core (store), a layer not below it",
        "engine.storage.local (storage) imports engine.packs.pack (packs), a layer not "
        "below it",
        "engine.store.gc imports the package facade; import the module",
    ]


def test_the_storage_check_refuses_packs_index_and_store():
    graph = {"engine.storage.s3": {"engine.store.packstore", "engine.format.trailer"},
             "engine.storage.local": {"engine.index.db", "engine.fs.fileio"},
             "engine.storage.shared": {"engine.packs.pack", "engine.storage.local"},
             "engine.packs.pack": {"engine.storage.base"}}
    assert _storage_reaches_up(graph) == [
        "engine.storage.local imports engine.index.db",
        "engine.storage.s3 imports engine.format.trailer",
        "engine.storage.s3 imports engine.store.packstore",
        "engine.storage.shared imports engine.packs.pack",
    ]


def test_the_graph_sees_deferred_and_type_checking_imports_in_subfolders(tmp_path):
    pkg = tmp_path / "engine"
    (pkg / "store" / "commit").mkdir(parents=True)
    (pkg / "storage").mkdir()
    for init in ("", "store", "store/commit", "storage"):
        (pkg / init / "__init__.py").write_text("")
    (pkg / "storage" / "s3.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..store.commit.bucket import Remote\n"
        "def open_bucket():\n    from ..store import core\n")
    (pkg / "store" / "core.py").write_text("x = 1\n")
    (pkg / "store" / "commit" / "bucket.py").write_text(
        "from ...storage import s3\nfrom engine.store.core import x\n")
    graph = ig.graph(["engine"], root=tmp_path)
    assert graph["engine.storage.s3"] == {"engine.store.commit.bucket", "engine.store.core"}
    assert graph["engine.store.commit.bucket"] == {"engine.storage.s3", "engine.store.core"}
    assert ig.cycles(graph) == [["engine.storage.s3", "engine.store.commit.bucket"]]
    assert _storage_reaches_up(graph) == [
        "engine.storage.s3 imports engine.store.commit.bucket",
        "engine.storage.s3 imports engine.store.core"]

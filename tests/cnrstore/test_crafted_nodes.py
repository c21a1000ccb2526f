"""Crafted table nodes (issue 8): an unknown dtype (one that names a torch attribute or a
lazily imported torch submodule), an unknown scheme, a row_nbytes that does not match, or
a shape of 2**40 rows. Deep verify reports each; restore refuses each with the store's own
error before allocating anything, and never imports a module named by a node."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from ckpt_util import random_table

import cnrstore
from cnrstore.format.load import load_manifest
from cnrstore.format.manifest import KIND_SEGMENT, KIND_STEP, KIND_TABLE, SegmentNode, root_name


def craft(store: cnrstore.CheckpointStore, step: int, new_step: int, **changes) -> None:
    """Write ``new_step``: a copy of ``step`` whose table node "t" has ``changes``."""
    m = load_manifest(store.objects, step)
    node = dataclasses.replace(m.tables["t"].node, **changes)
    payload, refs = node.encode()
    with store.objects.writer() as w:
        tid = w.put(KIND_TABLE, payload, refs, meta=True)
        snode = dataclasses.replace(m.node, step=new_step, table_ids=(tid,))
        payload, refs = snode.encode()
        w.set_root(root_name(new_step), w.put(KIND_STEP, payload, refs, meta=True))


CRAFTED = [
    {"dtype": "__class__"},
    {"dtype": "_dynamo"},
    {"dtype": "Tensor"},
    {"scheme": "int9"},
    {"row_nbytes": 5},
    {"shape": (2**40, 4), "block_rows": 2**40},
    {"shape": (2**40, 4), "fanout": 2**40, "block_rows": 2**30},
    {"shape": (-3, 4)},
]


@pytest.fixture
def store(tmp_path):
    s = cnrstore.open(tmp_path / "ckpt", block_rows=8, fanout=4)
    g = torch.Generator().manual_seed(0)
    s.put_tables(1, {"t": random_table(g, 8, 4)})
    yield s
    s.close()


@pytest.mark.parametrize("changes", CRAFTED, ids=[str(c) for c in CRAFTED])
def test_crafted_node_fails_deep_verify_and_restore_cleanly(store, changes):
    craft(store, 1, 2, **changes)
    report = store.verify(deep=True)
    assert not report.ok
    assert any("step 2" in p for p in report.problems), report.problems
    assert not any("step 1" in p for p in report.problems), report.problems
    with pytest.raises(cnrstore.CheckpointError):
        store.get_tables(2)
    assert store.get_tables(1)["t"].shape == (8, 4)


def test_crafted_dtype_never_imports_a_torch_submodule(tmp_path):
    code = f"""
import sys, torch, cnrstore
sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
from test_crafted_nodes import craft
s = cnrstore.open({str(tmp_path / 'c')!r}, block_rows=8, fanout=4)
s.put_tables(1, {{"t": torch.zeros(8, 4)}})
craft(s, 1, 2, dtype="_dynamo")
assert "torch._dynamo" not in sys.modules
s.verify(deep=True)
try:
    s.get_tables(2)
except cnrstore.CheckpointError:
    pass
print("dynamo" if "torch._dynamo" in sys.modules else "clean")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip().endswith("clean"), out.stdout + out.stderr


def test_consistent_node_of_2_40_rows_is_refused_without_allocating(store):
    """Segments that list enough blocks (the same small block 512 times) for a 2**40-row
    table: restore must fail on the blocks' real size, not try to allocate 16 TB."""
    m = load_manifest(store.objects, 1)
    block = m.tables["t"].block_ids[0]
    seg = SegmentNode((block,) * 256, (0,) * 256, (0,) * 256)
    with store.objects.writer() as w:
        payload, refs = seg.encode()
        sid = w.put(KIND_SEGMENT, payload, refs, meta=True)
    craft(store, 1, 2, shape=(2**40, 4), block_rows=2**31, fanout=256, segment_ids=(sid, sid))
    assert not store.verify(deep=True).ok
    with pytest.raises(cnrstore.CheckpointError):
        store.get_tables(2)
    with pytest.raises(cnrstore.CheckpointError):
        store.get_tables(2, rows={"t": slice(0, 8)})

"""Loading a step's manifest from the store: the readers that fetch a step, table or
segment node by root name or id and decode it, down to a step's ``StepManifest``.

The node formats and their checks live in cnrstore/format/manifest.py; these readers are
apart because they are about walking the DAG in a store (one index lookup and node read
each, checked before decoding by nodecaps.read_node), not about what a node holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cnrstore.errors import StepNotFound, TableNotFound
from cnrstore.format.manifest import (
    KIND_SEGMENT,
    KIND_STEP,
    KIND_TABLE,
    SegmentNode,
    StepManifest,
    StepNode,
    TableManifest,
    TableNode,
    root_name,
    step_of_root,
)
from cnrstore.format.nodecaps import read_node
from engine import ObjectStore

__all__ = ["list_steps", "load_manifest", "load_segment", "load_step", "load_table",
           "load_table_manifest", "segment_blocks"]


def list_steps(store: ObjectStore) -> list[int]:
    """Ascending steps whose roots the store holds."""
    steps = (step_of_root(name) for name in store.roots())
    return sorted(s for s in steps if s is not None)


def load_step(store: ObjectStore, step: int) -> tuple[bytes, StepNode]:
    """(root id, step node) of a step; StepNotFound if the store has no such step."""
    oid = store.root(root_name(step))
    if oid is None:
        raise StepNotFound(step)
    return oid, StepNode.decode(read_node(store, oid, KIND_STEP), oid)


def load_table(store: ObjectStore, oid: bytes) -> TableNode:
    return TableNode.decode(read_node(store, oid, KIND_TABLE), oid)


def segment_blocks(node: TableNode, j: int) -> int:
    """Blocks segment ``j`` of a (checked) table node holds: ``fanout``, fewer in the last."""
    return min(node.fanout, node.nblocks - j * node.fanout)


def load_segment(store: ObjectStore, node: TableNode, j: int) -> SegmentNode:
    """Segment ``j`` of ``node``: its ref count and size checked against the table's
    geometry in the index before its payload is read."""
    oid = node.segment_ids[j]
    n = segment_blocks(node, j)
    return SegmentNode.decode(read_node(store, oid, KIND_SEGMENT, n), oid, blocks=n)


def load_table_manifest(store: ObjectStore, oid: bytes) -> TableManifest:
    node = load_table(store, oid)
    segments = tuple(load_segment(store, node, j) for j in range(len(node.segment_ids)))
    return TableManifest(oid, node, segments)


def load_manifest(
    store: ObjectStore, step: int, *, names: Iterable[str] | None = None
) -> StepManifest:
    """Load a step's nodes down to segments (blocks are not read). ``names`` picks tables;
    unknown names raise TableNotFound."""
    oid, node = load_step(store, step)
    by_name = dict(zip(node.tables, node.table_ids))
    wanted: Sequence[str] = node.tables if names is None else list(names)
    tables = {}
    for name in wanted:
        if name not in by_name:
            raise TableNotFound(name, step)
        tables[name] = load_table_manifest(store, by_name[name])
    return StepManifest(oid, node, tables)

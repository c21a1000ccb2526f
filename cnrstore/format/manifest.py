"""The manifest: a Merkle DAG of step -> table -> segment -> block nodes (docs/MANIFEST.md).

Nodes are frozen dataclasses with ``encode() -> (payload, refs)`` and
``decode(engine.Object)``. Payloads are msgpack maps carrying the format version ``v``.
Row ranges are global to the logical table: block ``i`` of a table holds rows
``[i * block_rows, min((i + 1) * block_rows, rows))``; segment ``j`` refers to blocks
``[j * fanout, (j + 1) * fanout)``. Two steps' diff is a top-down id comparison
(``changed_blocks``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

from cnrstore.codec.layout import DTYPE_SIZES, dtype_name, parse_dtype
from cnrstore.errors import InvalidInput, ManifestError
from cnrstore.format.blocks import KIND_BLOCK_FULL, KIND_BLOCK_PATCH
from cnrstore.format.nodecaps import (
    KIND_SEGMENT,
    KIND_STEP,
    KIND_TABLE,
    MAX_NDIM,
    STEP_NODE_BYTES,
    STEP_NODE_ITEMS,
    check_node_size,
    node_caps,
    read_node,
    unpack_node,
)
from engine import Object

__all__ = [
    "FORMAT_VERSION",
    "KIND_STEP",
    "KIND_TABLE",
    "KIND_SEGMENT",
    "KIND_BLOCK_FULL",
    "KIND_BLOCK_PATCH",
    "StepNode",
    "TableNode",
    "SegmentNode",
    "TableManifest",
    "StepManifest",
    "root_name",
    "step_of_root",
    "changed_blocks",
    "DTYPE_SIZES",
    "parse_dtype",
    "dtype_name",
    "MAX_BLOCK_ROWS",
    "MAX_NDIM",
    "node_caps",
    "check_node_size",
    "read_node",
    "unpack_node",
    "check_step_fits",
    "STEP_NODE_BYTES",
    "STEP_NODE_ITEMS",
]

FORMAT_VERSION = 1  # docs/MANIFEST.md, "Versioning"

# Engine object kinds (docs/MANIFEST.md, "Object kinds"): KIND_STEP = 1, KIND_TABLE = 2 and
# KIND_SEGMENT = 3 come from nodecaps.py, KIND_BLOCK_FULL = 4 and KIND_BLOCK_PATCH = 5 from
# blocks.py.

ROOT_PREFIX = "step/"

# The table dtypes a node may name: DTYPE_SIZES (cnrstore.codec.layout), which also maps
# them to torch dtypes on first use, so decoding a node does not import torch.
# Largest block_rows / fanout a writer uses (CheckpointStore refuses more); bigger values
# in a node only come from damage or crafting.
MAX_BLOCK_ROWS = 1 << 31
_MAX_TABLE_BYTES = 1 << 62

def root_name(step: int) -> str:
    """Engine root name of a step: zero-padded so roots sort by step."""
    return f"{ROOT_PREFIX}{step:020d}"


def step_of_root(name: str) -> int | None:
    """The step a root name stands for, or None for roots that are not steps."""
    if not name.startswith(ROOT_PREFIX):
        return None
    digits = name[len(ROOT_PREFIX):]
    return int(digits) if digits.isdigit() else None


def _pack(doc: dict) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def _checked(kind: int, payload: bytes, refs: tuple[bytes, ...], what: str
             ) -> tuple[bytes, tuple[bytes, ...]]:
    try:
        check_node_size(kind, payload, len(refs))
    except ValueError as exc:
        raise InvalidInput(f"{what}: {exc}; store less metadata or fewer Python values "
                           "in the state") from None
    return payload, refs


def _unpack(obj: Object, kind: int, oid: bytes | None) -> dict:
    if obj.kind != kind:
        raise ManifestError(f"expected node kind {kind}, found {obj.kind}", oid=oid)
    doc = unpack_node(obj, kind, oid)
    if not isinstance(doc, dict) or doc.get("v") != FORMAT_VERSION:
        version = doc.get("v") if isinstance(doc, dict) else None
        raise ManifestError(f"manifest node has unknown format version {version!r}", oid=oid)
    return doc


@dataclass(frozen=True)
class StepNode:
    """Root of one step: its tables (refs, in order), user metadata, and put statistics."""

    step: int
    time: float
    tables: tuple[str, ...]
    table_ids: tuple[bytes, ...]
    metadata: dict = field(default_factory=dict)
    logical_bytes: int = 0          # sum of the put tables' sizes in bytes
    bytes_new: int = 0              # uncompressed payload bytes of objects new in this step
    rows_changed: dict = field(default_factory=dict)
    # Structure of a put_state step (cnrstore/core/state.py); None for put_tables. Optional key:
    # step nodes without it encode exactly as before, so their ids do not change.
    state: dict | None = None

    def encode(self) -> tuple[bytes, tuple[bytes, ...]]:
        doc = {
            "v": FORMAT_VERSION,
            "step": self.step,
            "time": self.time,
            "metadata": self.metadata,
            "tables": list(self.tables),
            "info": {
                "logical_bytes": self.logical_bytes,
                "bytes_new": self.bytes_new,
                "rows_changed": dict(self.rows_changed),
            },
        }
        if self.state is not None:
            doc["state"] = self.state
        return _checked(KIND_STEP, _pack(doc), tuple(self.table_ids), f"step {self.step}")

    @classmethod
    def decode(cls, obj: Object, oid: bytes | None = None) -> StepNode:
        doc = _unpack(obj, KIND_STEP, oid)
        try:
            tables = tuple(doc["tables"])
            info = doc["info"]
            if len(tables) != len(obj.refs):
                raise ValueError("table names and refs differ in length")
            return cls(
                step=int(doc["step"]),
                time=float(doc["time"]),
                tables=tables,
                table_ids=tuple(obj.refs),
                metadata=doc["metadata"],
                logical_bytes=int(info["logical_bytes"]),
                bytes_new=int(info["bytes_new"]),
                rows_changed=dict(info["rows_changed"]),
                state=doc.get("state"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed step node: {exc}", oid=oid) from exc


def check_step_fits(step: int, names: Sequence[str], metadata: dict, state: dict | None) -> None:
    """InvalidInput unless the step node of a put of tables ``names`` fits its caps, with
    every statistic at its widest: a put checks this before anything is written."""
    widest = (1 << 64) - 1
    StepNode(step, 0.0, tuple(names), (bytes(16),) * len(names), metadata, widest, widest,
             dict.fromkeys(names, widest), state).encode()


@dataclass(frozen=True)
class TableNode:
    """One table of a step: its logical shape and encoding, and its segments (refs)."""

    name: str
    shape: tuple[int, ...]
    dtype: str                  # torch dtype name without "torch.", e.g. "float32"
    scheme: str                 # quantization scheme, e.g. "exact", "int8"
    block_rows: int
    fanout: int
    row_nbytes: int             # encoded bytes per row
    segment_ids: tuple[bytes, ...]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def width(self) -> int:
        """Elements per row (product of the dims after the first)."""
        return math.prod(self.shape[1:])

    @property
    def nblocks(self) -> int:
        return -(-self.rows // self.block_rows)

    def block_range(self, i: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of block ``i``."""
        start = i * self.block_rows
        return start, min(start + self.block_rows, self.rows)

    def _check_geometry(self, oid: bytes | None) -> None:
        """Everything a reader sizes buffers by, checked before anything is allocated."""
        from cnrstore.codec.layout import SCHEMES, check_scheme_name, row_nbytes_options_of

        def bad(why: str) -> ManifestError:
            return ManifestError(f"table node {self.name!r}: {why}", oid=oid)

        if not self.shape or len(self.shape) > MAX_NDIM or any(d < 0 for d in self.shape):
            raise bad(f"invalid shape {self.shape}" if len(self.shape) <= MAX_NDIM else
                      f"shape has {len(self.shape)} dims, more than {MAX_NDIM}")
        if not 1 <= self.block_rows <= MAX_BLOCK_ROWS or not 1 <= self.fanout <= MAX_BLOCK_ROWS:
            raise bad(f"invalid block_rows {self.block_rows} or fanout {self.fanout}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise ManifestError(f"unknown table dtype {self.dtype!r}", oid=oid)
        if self.scheme not in SCHEMES:
            raise bad(f"unknown scheme {self.scheme!r}")
        try:
            check_scheme_name(self.scheme, self.dtype, table=self.name)
        except ValueError as exc:
            raise bad(str(exc)) from None
        if math.prod(self.shape) * DTYPE_SIZES[self.dtype] > _MAX_TABLE_BYTES:
            raise bad(f"shape {self.shape} is too large to be a table")
        options = row_nbytes_options_of(self.scheme, self.dtype, self.width)
        if self.row_nbytes not in options:
            raise bad(
                f"row_nbytes {self.row_nbytes} does not match scheme {self.scheme!r} with "
                f"{self.width} {self.dtype} elements ({' or '.join(map(str, options))})"
            )

    def encode(self) -> tuple[bytes, tuple[bytes, ...]]:
        doc = {
            "v": FORMAT_VERSION,
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "scheme": self.scheme,
            "block_rows": self.block_rows,
            "fanout": self.fanout,
            "row_nbytes": self.row_nbytes,
        }
        return _checked(KIND_TABLE, _pack(doc), tuple(self.segment_ids),
                        f"table {self.name!r}")

    @classmethod
    def decode(cls, obj: Object, oid: bytes | None = None) -> TableNode:
        doc = _unpack(obj, KIND_TABLE, oid)
        try:
            node = cls(
                name=str(doc["name"]),
                shape=tuple(int(d) for d in doc["shape"]),
                dtype=str(doc["dtype"]),
                scheme=str(doc["scheme"]),
                block_rows=int(doc["block_rows"]),
                fanout=int(doc["fanout"]),
                row_nbytes=int(doc["row_nbytes"]),
                segment_ids=tuple(obj.refs),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed table node: {exc}", oid=oid) from exc
        node._check_geometry(oid)
        if len(node.segment_ids) != -(-node.nblocks // node.fanout):
            raise ManifestError(
                f"table node {node.name!r} has {len(node.segment_ids)} segments for "
                f"{node.nblocks} blocks of fanout {node.fanout}",
                oid=oid,
            )
        return node


@dataclass(frozen=True)
class SegmentNode:
    """Up to ``fanout`` consecutive blocks of a table, with each block's patch-chain state:
    ``depth`` patches above its full block and ``chain_bytes`` of patch payload in the
    chain (0 and 0 for a full block). Writers use these to bound chains without reading
    blocks."""

    block_ids: tuple[bytes, ...]
    depth: tuple[int, ...]
    chain_bytes: tuple[int, ...]

    def encode(self) -> tuple[bytes, tuple[bytes, ...]]:
        doc = {
            "v": FORMAT_VERSION,
            "depth": list(self.depth),
            "chain_bytes": list(self.chain_bytes),
        }
        return _pack(doc), tuple(self.block_ids)

    @classmethod
    def decode(cls, obj: Object, oid: bytes | None = None, *,
               blocks: int | None = None) -> SegmentNode:
        """``blocks``: the block count the table's geometry gives this segment (checked
        before the payload is unpacked)."""
        if blocks is not None and len(obj.refs) != blocks:
            raise ManifestError(f"segment node {oid.hex() if oid else ''} has "
                                f"{len(obj.refs)} block refs, its table needs {blocks}",
                                oid=oid)
        doc = _unpack(obj, KIND_SEGMENT, oid)
        try:
            depth = tuple(int(d) for d in doc["depth"])
            chain = tuple(int(b) for b in doc["chain_bytes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed segment node: {exc}", oid=oid) from exc
        if not len(depth) == len(chain) == len(obj.refs):
            raise ManifestError("segment node lists differ in length", oid=oid)
        return cls(tuple(obj.refs), depth, chain)


@dataclass(frozen=True)
class TableManifest:
    """A table node with its segments loaded: the complete block list of a table."""

    oid: bytes
    node: TableNode
    segments: tuple[SegmentNode, ...]

    @property
    def block_ids(self) -> list[bytes]:
        return [b for s in self.segments for b in s.block_ids]

    @property
    def depth(self) -> list[int]:
        return [d for s in self.segments for d in s.depth]

    @property
    def chain_bytes(self) -> list[int]:
        return [c for s in self.segments for c in s.chain_bytes]


@dataclass(frozen=True)
class StepManifest:
    """A step node with (some of) its tables loaded, in the step's table order."""

    oid: bytes
    node: StepNode
    tables: dict[str, TableManifest]


def changed_blocks(old: TableManifest, new: TableManifest) -> list[int]:
    """Indices of the blocks of ``new`` whose ids differ from ``old`` (all of them when the
    geometry differs). Equal segment ids are skipped without looking at their blocks."""
    a, b = old.node, new.node
    if (a.block_rows, a.fanout) != (b.block_rows, b.fanout):
        return list(range(b.nblocks))
    out: list[int] = []
    for j, seg in enumerate(new.segments):
        base = j * b.fanout
        if j < len(old.segments) and old.node.segment_ids[j] == b.segment_ids[j]:
            continue
        old_ids = old.segments[j].block_ids if j < len(old.segments) else ()
        for k, bid in enumerate(seg.block_ids):
            if k >= len(old_ids) or old_ids[k] != bid:
                out.append(base + k)
    return out

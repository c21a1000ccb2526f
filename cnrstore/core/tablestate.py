"""The per-table diff base a store handle keeps between puts (not stored; docs/MANIFEST.md,
"Diff base").

A ``TableState`` describes one table as of the handle's last put or restore: its
geometry and encoding, the row fingerprints (on the table's device) that the next put
compares against, and one ``BlockSlot`` per block. Each put builds a new state: slots of
unchanged blocks are shared with the previous state, changed blocks get new slots whose
``oid`` the background writer fills in when it writes them. Because the writer commits puts
in order, a later put's patches always find their base's id filled in, unless that earlier
put failed (then ``oid`` stays None and the dependent put fails too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cnrstore.format.manifest import TableManifest, dtype_name, parse_dtype

__all__ = ["BlockSlot", "TableState", "dtype_name", "parse_dtype"]


class BlockSlot:
    """One block of one table version: its object id (None until written) and the state
    of its patch chain."""

    __slots__ = ("oid", "nrows", "depth", "chain_bytes")

    def __init__(self, nrows: int, depth: int = 0, chain_bytes: int = 0, oid: bytes | None = None):
        self.oid = oid
        self.nrows = nrows
        self.depth = depth
        self.chain_bytes = chain_bytes

    def __repr__(self) -> str:
        oid = self.oid.hex()[:12] if self.oid else None
        return f"BlockSlot({oid}, nrows={self.nrows}, depth={self.depth})"




@dataclass
class TableState:
    """Diff base of one table. ``fingerprints`` or ``seed_codes`` (not both) says how the next
    put finds changed rows: by fingerprint, or (seeded from a lossy restore, where the raw
    rows are unknown) by comparing the new rows' codes with the stored codes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    scheme: str
    block_rows: int
    fanout: int
    row_nbytes: int
    slots: list[BlockSlot | None]           # None: no usable base (write the block full)
    fingerprints: torch.Tensor | None = None    # int64[rows], on the table's device
    seed_codes: torch.Tensor | None = None      # uint8[rows, row_nbytes], on CPU
    # The writer's cache of segment ids: (block ids of the segment, segment id) per index.
    segments: list[tuple[tuple[bytes, ...], bytes] | None] = field(default_factory=list)
    # (root name, step node id) of a committed step that reaches every slot: while that
    # root is unchanged, gc cannot have dropped a slot's block. None while pending.
    anchor: tuple[str, bytes] | None = None
    # Blocks of a base seeded from the store that could not be read (damaged): written in
    # full by the next put, never as a reuse of the damaged record (issue 8).
    damaged_blocks: frozenset[int] = frozenset()
    # Root name of the put that made this state (its anchor once committed).
    planned_root: str | None = None

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def width(self) -> int:
        return math.prod(self.shape[1:])

    def compatible(
        self, shape: tuple[int, ...], dtype: torch.dtype, scheme: str, block_rows: int, fanout: int
    ) -> bool:
        """True when a new version of the table can reuse and patch this one's blocks."""
        return (
            tuple(shape[1:]) == tuple(self.shape[1:])
            and dtype == self.dtype
            and scheme == self.scheme
            and block_rows == self.block_rows
            and fanout == self.fanout
        )

    def has_diff(self) -> bool:
        return self.fingerprints is not None or self.seed_codes is not None

    def revalidate(self, root, has) -> int:
        """Before diffing against this state: if its anchor step was deleted or replaced
        (by this or another process), forget the slots whose blocks the engine no longer
        holds, so they are written full. ``root(name)`` reads a root, ``has(oid)`` checks
        an object. Returns how many slots were dropped."""
        if self.anchor is None or root(self.anchor[0]) == self.anchor[1]:
            return 0
        self.anchor = None  # checked now; the next put anchors its own state
        return self.drop_missing(has)

    def drop_missing(self, has) -> int:
        """Forget slots whose object the engine no longer holds (after gc or delete_step), so
        their blocks are written full next time. Returns how many were dropped."""
        dropped = 0
        for i, slot in enumerate(self.slots):
            if slot is not None and (slot.oid is None or not has(slot.oid)):
                self.slots[i] = None
                dropped += 1
        if dropped:
            self.segments = []
        return dropped

    @classmethod
    def from_manifest(
        cls,
        tm: TableManifest,
        *,
        fingerprints: torch.Tensor | None = None,
        seed_codes: torch.Tensor | None = None,
        anchor: tuple[str, bytes] | None = None,
    ) -> TableState:
        """State of a stored table (seeding after a restore, or from the newest step)."""
        node = tm.node
        slots: list[BlockSlot | None] = []
        for i, (oid, depth, chain) in enumerate(zip(tm.block_ids, tm.depth, tm.chain_bytes)):
            start, stop = node.block_range(i)
            slots.append(BlockSlot(stop - start, depth, chain, oid))
        segments: list[tuple[tuple[bytes, ...], bytes] | None] = [
            (seg.block_ids, sid) for seg, sid in zip(tm.segments, node.segment_ids)
        ]
        return cls(
            shape=node.shape,
            dtype=parse_dtype(node.dtype),
            scheme=node.scheme,
            block_rows=node.block_rows,
            fanout=node.fanout,
            row_nbytes=node.row_nbytes,
            slots=slots,
            fingerprints=fingerprints,
            seed_codes=seed_codes,
            segments=segments,
            anchor=anchor,
        )

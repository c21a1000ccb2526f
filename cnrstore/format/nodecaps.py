"""Memory caps of manifest nodes (docs/MANIFEST.md, "Memory caps"): how large a node's
payload may be and how many msgpack entries it may hold, checked in the index before a
node is read (``read_node``) and again as it is unpacked (``unpack_bounded``), and by
writers before one is written (``check_node_size``). A crafted node of a few KB that zstd
expands to a 32 MiB array then no longer makes a reader build a 256 MiB list."""

from __future__ import annotations

import msgpack

from cnrstore.errors import ManifestError
from engine import Object, ObjectStore

__all__ = ["KIND_STEP", "KIND_TABLE", "KIND_SEGMENT", "NODE_NAMES", "MAX_NDIM",
           "node_caps", "unpack_bounded", "unpack_node", "check_node_size", "read_node"]

# Engine object kinds of the nodes (docs/MANIFEST.md, "Object kinds").
KIND_STEP = 1
KIND_TABLE = 2
KIND_SEGMENT = 3

# Memory caps (docs/MANIFEST.md, "Memory caps"). A node's payload is checked against its
# cap in the index (before it is read or decompressed) and unpacked with every msgpack
# container counted: an entry costs a reader up to ~100 bytes (an empty list is 56 bytes
# from one payload byte), so a crafted node of a few KB that zstd expands to a 32 MiB
# array no longer makes a reader build a 256 MiB list. Writers refuse a node past these
# (check_node_size), so everything stored is readable.
MAX_NDIM = 64                       # dims of a table's shape (put refuses more: validate.py)
STEP_NODE_BYTES = 16 << 20          # + STEP_NODE_BYTES_PER_TABLE per table ref
STEP_NODE_BYTES_PER_TABLE = 256
STEP_NODE_ITEMS = 1 << 19           # + STEP_NODE_ITEMS_PER_TABLE per table ref
STEP_NODE_ITEMS_PER_TABLE = 16
TABLE_NODE_BYTES = 1 << 20
TABLE_NODE_ITEMS = 2 * MAX_NDIM + 64
# A segment of n blocks: two arrays of n ints (at most 9 bytes each) and a few keys.
SEGMENT_NODE_BYTES_PER_BLOCK = 18
SEGMENT_NODE_BYTES = 64


NODE_NAMES = {KIND_STEP: "step", KIND_TABLE: "table", KIND_SEGMENT: "segment"}


def node_caps(kind: int, nrefs: int) -> tuple[int, int]:
    """(payload bytes, msgpack entries) a node of ``kind`` with ``nrefs`` refs may have."""
    if kind == KIND_STEP:
        return (STEP_NODE_BYTES + STEP_NODE_BYTES_PER_TABLE * nrefs,
                STEP_NODE_ITEMS + STEP_NODE_ITEMS_PER_TABLE * nrefs)
    if kind == KIND_TABLE:
        return TABLE_NODE_BYTES, TABLE_NODE_ITEMS
    if kind == KIND_SEGMENT:
        return SEGMENT_NODE_BYTES + SEGMENT_NODE_BYTES_PER_BLOCK * nrefs, 2 * nrefs + 16
    raise ValueError(f"kind {kind} is not a manifest node")


class _TooLarge(Exception):
    pass


def unpack_bounded(payload: bytes, max_items: int) -> object:
    """msgpack ``payload`` with at most ``max_items`` entries in all its arrays and maps
    (each container counts one more): ``_TooLarge`` as soon as the count passes, so a
    reader never builds more than that plus the container being built (whose length
    msgpack bounds by ``max_items`` too)."""
    count = 0

    def counted(container):
        nonlocal count
        count += len(container) * (2 if isinstance(container, dict) else 1) + 1
        if count > max_items:
            raise _TooLarge
        return container

    return msgpack.unpackb(payload, raw=False, strict_map_key=False, list_hook=counted,
                           object_hook=counted, max_array_len=max_items,
                           max_map_len=max_items // 2, max_ext_len=0)


def unpack_node(obj: Object, kind: int, oid: bytes | None) -> object:
    """The msgpack document of node ``obj`` (of ``kind``), held to its kind's caps;
    ManifestError naming it otherwise, or when it is not msgpack."""
    max_bytes, max_items = node_caps(kind, len(obj.refs))
    name = f"{NODE_NAMES[kind]} node" + (f" {oid.hex()}" if oid is not None else "")
    if len(obj.payload) > max_bytes:
        raise ManifestError(f"{name} payload is {len(obj.payload)} bytes, more than the "
                            f"{max_bytes} its kind may have", oid=oid)
    try:
        return unpack_bounded(obj.payload, max_items)
    except _TooLarge:
        raise ManifestError(f"{name} holds more than the {max_items} msgpack entries its "
                            "kind may have", oid=oid) from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ManifestError(f"{name} is not msgpack: {exc}", oid=oid) from exc


def check_node_size(kind: int, payload: bytes, nrefs: int) -> None:
    """ValueError unless a node's encoded ``payload`` is within its kind's caps: writers
    call this before a node is written, so every stored node is one a reader accepts."""
    max_bytes, max_items = node_caps(kind, nrefs)
    name = NODE_NAMES[kind]
    if len(payload) > max_bytes:
        raise ValueError(f"the {name} node would take {len(payload)} bytes, more than the "
                         f"{max_bytes} a {name} node may (docs/MANIFEST.md, 'Memory caps')")
    try:
        unpack_bounded(payload, max_items)
    except _TooLarge:
        raise ValueError(f"the {name} node would hold more than {max_items} msgpack "
                         "entries (docs/MANIFEST.md, 'Memory caps')") from None


def read_node(store: ObjectStore, oid: bytes, kind: int, nrefs: int | None = None) -> Object:
    """Object ``oid``, a node of ``kind``, its size checked in the index against the
    kind's cap before its payload is read or decompressed (ManifestError naming it).
    ``nrefs``: the refs it must have (a segment's block count), checked first too."""
    info = store.info(oid)
    name = NODE_NAMES[kind]
    if info.kind != kind:
        raise ManifestError(f"object {oid.hex()}: expected a {name} node (kind {kind}), "
                            f"found kind {info.kind}", oid=oid)
    if nrefs is not None and len(info.refs) != nrefs:
        raise ManifestError(f"{name} node {oid.hex()} has {len(info.refs)} refs, its table "
                            f"needs {nrefs}", oid=oid)
    max_bytes = node_caps(kind, len(info.refs))[0]
    if info.raw_len > max_bytes:
        raise ManifestError(f"{name} node {oid.hex()} claims a {info.raw_len}-byte payload, "
                            f"more than the {max_bytes} a {name} node may have", oid=oid)
    return store.get(oid)



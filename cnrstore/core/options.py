"""The options of a store handle: listed here once, validated once, and the data-describing
ones persisted with the store (docs/MANIFEST.md, "Options object").

``block_rows`` and ``fanout`` are the geometry of every table node a handle writes; a put
can only diff against a stored table of the same geometry, so a handle opened with other
values than the store's would silently write every table in full. They are stored in an
options object (root ``cnrstore/options``) by the first put and read back on open: left
out, they take the stored values; given and different, the open raises OptionsMismatch.
The other options are how this handle works and are never stored.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from cnrstore.errors import CheckpointError, InvalidInput, InvalidType, ManifestError
from cnrstore.format.load import list_steps, load_step, load_table
from engine import ObjectStore, StoreError, Writer

__all__ = ["Options", "OptionsMismatch", "DATA_OPTIONS", "OPTIONS_ROOT", "KIND_OPTIONS",
           "GROUPED_BLOCK_ROWS", "positive", "default_block_rows", "make_options", "read_stored",
           "resolve_stored", "ensure_stored", "LAYOUTS"]

OPTIONS_ROOT = "cnrstore/options"
KIND_OPTIONS = 6
# The options that describe stored data (persisted, checked on open).
DATA_OPTIONS = ("block_rows", "fanout")
_DEFAULT_GEOMETRY = {"block_rows": 32768, "fanout": 256}
# A new store of the grouped layout takes larger blocks: a block's row objects and list
# node per step cost the same whatever its rows, and at 1% changed int8 rows those were
# 0.13x of a step's changed bytes at 32768 rows (docs/design/grouped-layout.md, "Larger
# blocks and five classes"). Stores that hold their block_rows keep it.
GROUPED_BLOCK_ROWS = 131072
# The block layouts (the first the default); stored only when not the default, so the
# options object of a store of chains is what it always was.
LAYOUTS = ("chains", "grouped")


class OptionsMismatch(InvalidInput):
    """The store was written with other data-describing options than the ones given."""


@dataclass(frozen=True)
class Options:
    """Options of a store handle (``cnrstore.open(path, **options)`` takes the same names).

    - ``block_rows`` (stored; new store 32768, 131072 of the grouped layout): rows per
      block, the unit of patching and of partial restores. None: the store's.
    - ``fanout`` (stored; new store 256): blocks per segment node. None: the store's.
    - ``max_chain`` (64): most patches above a full block; each block's own cap lies in
      [max_chain/2, max_chain] (core/chainpolicy.py), so blocks are not rewritten at once.
    - ``max_inflight`` (2): non-blocking puts that may wait or run before a put blocks.
    - ``decode_threads``: threads decoding blocks on restore (None: CPU count, <= 8).
    - ``expected_restores`` (1): what ``quant="auto"`` bases its choice on.
    - ``seed_from_store`` (True): a table's first put in this handle diffs against the
      newest stored step holding it (same geometry), so it is incremental, not full.
    - ``lock_timeout`` (60 s): how long a write waits for another process's writer.
    - ``host_buffer_bytes`` (2 GiB): host staging buffers kept for reuse across puts.
    - ``progress_min_bytes`` (64 MiB): calls given ``progress=`` report only when their
      work is at least this large (cnrstore/core/progress.py).
    - ``layout`` (stored; new store "chains"): how a block's versions are stored:
      "chains" (full blocks and patch chains) or "grouped" (lists of row objects grouped
      by change rate, docs/design/diff-base.md "Rows grouped by rate"). None: the store's.
    """

    block_rows: int | None = None
    fanout: int | None = None
    max_chain: int = 64
    max_inflight: int = 2
    decode_threads: int | None = None
    expected_restores: int = 1
    seed_from_store: bool = True
    lock_timeout: float | None = 60.0
    host_buffer_bytes: int = 2 << 30
    progress_min_bytes: int = 64 << 20
    layout: str | None = None

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout not in LAYOUTS:
            raise InvalidInput(f"layout must be one of {', '.join(LAYOUTS)}, got "
                               f"{self.layout!r}")
        for name in DATA_OPTIONS:
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
        if self.block_rows is not None and self.block_rows > 1 << 31:
            raise InvalidInput("block_rows must fit in 32 bits")
        positive("max_chain", self.max_chain, lo=0)
        positive("max_inflight", self.max_inflight)
        if self.decode_threads is not None:
            positive("decode_threads", self.decode_threads)
        positive("expected_restores", self.expected_restores, lo=0)
        positive("host_buffer_bytes", self.host_buffer_bytes, lo=0)
        positive("progress_min_bytes", self.progress_min_bytes, lo=0)
        if not isinstance(self.seed_from_store, bool):
            raise InvalidType(f"seed_from_store must be a bool, got {self.seed_from_store!r}")
        if self.lock_timeout is not None and (
            not isinstance(self.lock_timeout, (int, float)) or isinstance(self.lock_timeout, bool)
            or self.lock_timeout < 0
        ):
            raise InvalidInput(f"lock_timeout must be None or >= 0, got {self.lock_timeout!r}")

    @property
    def rows(self) -> int:
        """block_rows of a resolved options object (never None)."""
        return self.block_rows or default_block_rows(self.layout)

    @property
    def block_layout(self) -> str:
        """layout of a resolved options object (never None)."""
        return self.layout or LAYOUTS[0]

    @property
    def segment_fanout(self) -> int:
        """fanout of a resolved options object (never None)."""
        return self.fanout or _DEFAULT_GEOMETRY["fanout"]


def default_block_rows(layout: str | None) -> int:
    """block_rows of a new store of ``layout`` (None: the default layout)."""
    return GROUPED_BLOCK_ROWS if layout == "grouped" else _DEFAULT_GEOMETRY["block_rows"]


def positive(name: str, value, *, lo: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise InvalidInput(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def make_options(options: Options | None, overrides: Mapping[str, object]) -> Options:
    """``options`` (default Options()) with the keyword arguments of open() applied."""
    if options is not None and not isinstance(options, Options):
        raise InvalidType(f"options must be a cnrstore.Options, got {type(options).__name__}")
    names = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise InvalidType(f"unknown store option(s) {', '.join(unknown)}; the options are "
                          f"{', '.join(sorted(names))}")
    return dataclasses.replace(options or Options(), **overrides)  # type: ignore[arg-type]


def read_stored(objects: ObjectStore) -> dict[str, int | str] | None:
    """The stored data-describing options, None when the store holds none; ManifestError
    (or the engine's error) when the options object is damaged."""
    oid = objects.root(OPTIONS_ROOT)
    if oid is None:
        return None  # a store written before options were stored, or an empty one
    obj = objects.get(oid)
    try:
        doc = msgpack.unpackb(obj.payload, raw=False)
    except Exception as exc:  # msgpack raises several types on garbage
        raise ManifestError(f"options object is not msgpack: {exc}", oid=oid) from exc
    if obj.kind != KIND_OPTIONS or not isinstance(doc, dict) or doc.get("v") != 1:
        raise ManifestError("options object has a bad kind or version", oid=oid)
    stored = {k: doc.get(k) for k in DATA_OPTIONS}
    for k, v in stored.items():
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 1 << 31:
            raise ManifestError(f"options object holds {k}={v!r}", oid=oid)
    layout = doc.get("layout", LAYOUTS[0])
    if layout not in LAYOUTS:
        raise ManifestError(f"options object holds layout={layout!r}", oid=oid)
    out: dict[str, int | str] = {k: int(v) for k, v in stored.items()}  # type: ignore[arg-type]
    out["layout"] = layout
    return out


def resolve_stored(objects: ObjectStore, options: Options) -> Options:
    """``options`` with the data-describing values the store holds filled in (defaults for
    a store that holds none); OptionsMismatch when a given value differs from the stored
    one. ``decode_threads`` is resolved too."""
    try:
        stored = read_stored(objects) or {}
    except (ManifestError, StoreError):
        # A damaged options object must not stop a checkpoint (verify reports it): the
        # handle uses the given or the steps' geometry, at worst writing tables in full.
        stored = {}
    if not stored:
        stored = _steps_geometry(objects)
    resolved: dict[str, Any] = {}
    for name in (*DATA_OPTIONS, "layout"):
        given, have = getattr(options, name), stored.get(name)
        if given is not None and have is not None and given != have:
            raise OptionsMismatch(
                f"{name}={given} was given, but the store was written with {name}={have}; "
                f"leave {name} out to use the store's")
        resolved[name] = given or have or _DEFAULT_GEOMETRY.get(name, LAYOUTS[0])
    if not (options.block_rows or stored.get("block_rows")):
        resolved["block_rows"] = default_block_rows(resolved["layout"])
    threads = options.decode_threads or min(8, os.cpu_count() or 1)
    return dataclasses.replace(options, decode_threads=threads,
                               block_rows=resolved["block_rows"], fanout=resolved["fanout"],
                               layout=resolved["layout"])


def _steps_geometry(objects: ObjectStore) -> dict[str, int | str]:
    """The geometry of the newest step's first table, for a store holding steps but no
    (readable) options object: one written before options were stored, when a new store
    took 4096-row blocks. Opened with today's default it would write every table of its
    next put in full; {} when it holds no step (or the step cannot be read)."""
    try:
        steps = list_steps(objects)
        if not steps:
            return {}
        _, node = load_step(objects, steps[-1])
        if not node.table_ids:
            return {}
        table = load_table(objects, node.table_ids[0])
    except (CheckpointError, StoreError):
        return {}
    return {"block_rows": table.block_rows, "fanout": table.fanout}


def ensure_stored(objects: ObjectStore, w: Writer, options: Options) -> None:
    """Store ``options``' data-describing values in the transaction ``w`` (writer lock
    held) unless the store holds them already."""
    try:
        if objects.root(OPTIONS_ROOT) is not None:
            return
    except StoreError:
        return  # never let the options record stop a checkpoint
    doc: dict = {"v": 1, "block_rows": options.rows, "fanout": options.segment_fanout}
    if options.block_layout != LAYOUTS[0]:
        doc["layout"] = options.block_layout
    oid = w.put(KIND_OPTIONS, msgpack.packb(doc, use_bin_type=True), (), meta=True)
    # set_root, not create_root: the check above ran under the writer lock, and a lost
    # race must not turn into a refused step (create_root's RootExists).
    w.set_root(OPTIONS_ROOT, oid)

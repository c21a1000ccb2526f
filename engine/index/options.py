"""The copy of the engine options an index keeps (``meta.options``, docs/FORMAT.md
"Index"), read back on open; engine/format/options.py is the rule for using it."""

from __future__ import annotations

from typing import Any

import msgpack

from . import db as ix


def read_stored(index: ix.Index) -> dict[Any, Any] | None:
    """``meta.options`` of ``index``, or None when it is absent, fails the meta checksum or
    is not a msgpack map (it is derived data: a damaged copy only loses the stored tuning
    defaults)."""
    raw, damaged = index.read(lambda t: (t.get(ix.META_OPTIONS, db=index.meta),
                                         ix.meta_problem(t, index.meta)))
    if raw is None or damaged:
        return None
    try:
        value = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    return value if isinstance(value, dict) else None

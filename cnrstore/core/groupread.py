"""Resolving a grouped-layout block version (a list node of row objects,
cnrstore/format/rowlists.py) with its row objects read together.

``rowlists.resolve_list`` reads the ~175 objects of a long run's block one ``get`` at a
time: an index lookup, a pread and a check each, which made the grouped restore ~3x a
chain store's (docs/design/grouped-layout.md, "Reads"). Here the list is read first, then
all its objects with one ``get_many`` (a window's located records through the engine's
``get_many_at``: adjacent records one pread), and applied in list order exactly as
``resolve_list`` applies them, with its checks; the row objects are parsed by
cnrstore/format/rowobjects.py alone (both versions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from cnrstore.errors import ManifestError
from cnrstore.format.planes import unplanes
from cnrstore.format.rowlists import ListEntries, read_list
from cnrstore.format.rowobjects import IDS_SPAN, decode_rows_object, read_rows_header
from engine import Object

__all__ = ["apply_list", "resolve_grouped"]

GetMany = Callable[[Sequence[bytes]], Sequence[Object]]


def resolve_grouped(get: Callable[[bytes], Object], get_many: GetMany, oid: bytes,
                    obj: Object | None = None, *, out: np.ndarray | None = None
                    ) -> np.ndarray:
    """``resolve_list(get, oid, obj, out=out)``, the listed row objects read by one
    ``get_many`` (the objects of the ids given, in their order)."""
    entries = read_list(get, oid, obj)
    if not entries.refs:
        raise ManifestError("block list is empty", oid=oid)
    parts = get_many(entries.refs)
    if len(parts) != len(entries.refs):
        raise ManifestError("block list's objects were not all read", oid=oid)
    return apply_list(entries, parts, oid, out=out)


def apply_list(entries: ListEntries, parts: Sequence[Object], oid: bytes, *,
               out: np.ndarray | None = None) -> np.ndarray:
    """The block's codes from its list ``entries`` and their row objects ``parts`` (in
    list order): a row's value is its copy in the last object holding it. ManifestError
    when an object does not fit its entry or the block, or a row has no copy."""
    codes = out
    covered: np.ndarray | None = None
    for k, (ref, part) in enumerate(zip(entries.refs, parts)):
        head = read_rows_header(part, ref)
        if (head.count, head.cls, head.step) != (entries.rows[k], entries.cls[k],
                                                 entries.steps[k]):
            raise ManifestError(f"row object {ref.hex()} does not match its list entry",
                                oid=oid)
        if codes is None:
            codes = np.empty((head.nrows, head.row_nbytes), dtype=np.uint8)
        if covered is None:
            covered = np.zeros(len(codes), dtype=bool)
        if (head.nrows, head.row_nbytes) != codes.shape:
            raise ManifestError("row object does not match its block's shape", oid=ref)
        if head.ids == IDS_SPAN:
            # a span (the full put's chunks): its planes straight into the block's rows
            view = memoryview(part.payload)[head.body_at:]
            unplanes(view, head.count, head.row_nbytes, head.elem,
                     codes[head.start:head.start + head.count])
            covered[head.start:head.start + head.count] = True
            continue
        _, idx, _, got = decode_rows_object(part, ref, rates=False)
        assert idx is not None and got is not None
        codes[idx] = got
        covered[idx] = True
    assert codes is not None and covered is not None
    if not covered.all():
        raise ManifestError(f"block list leaves {int((~covered).sum())} rows with no copy",
                            oid=oid)
    return codes

"""A grouped block version's row objects applied to the block's rows (``apply_list``, which
rowlists.resolve_list calls with the objects its list names, in list order).

A long run's block version lists ~350 row objects (1 M x 64 fp32, 1% changed rows, 150
steps), and one at a time each costs a header parse, an id decode of ~10 numpy calls
(Rice or Elias-Fano) and a scatter of its rows: ~100 us of Python an object, with the GIL
held, made most of a grouped restore (docs/design/grouped-layout.md, "Reads"). Where the
codec's kernels are loaded (cnrstore/codec/native.py) ``cnr_apply_rows`` does a block's
whole list in one call, with the GIL released: every object checked as
``read_rows_header`` and ``decode_rows_object`` check it, its ids decoded, and the
objects taken last to first, each row copied once, from its last copy in list order
(a list holds ~1.5 copies of a row: the rest are never copied). ``apply_each`` is the
reference, one object at a time in list order, and the path without a compiler: an
object the kernel refuses (or a row left with no copy) sends the block to it, which
raises its own error, so both refuse exactly the same lists and return the same rows
(tests/cnrstore/test_rowapply.py holds them to it).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from cnrstore.codec import native
from cnrstore.errors import ManifestError
from cnrstore.format.planes import unplanes
from cnrstore.format.rowobjects import (
    IDS_SPAN,
    KIND_BLOCK_ROWS,
    decode_rows_object,
    read_rows_header,
)
from engine import Object

__all__ = ["apply_list", "apply_each", "apply_native"]


def apply_list(entries: Any, parts: Sequence[Object], oid: bytes, *,
               out: np.ndarray | None = None) -> np.ndarray:
    """The block's codes from its list ``entries`` (rowlists.ListEntries) and their row
    objects ``parts`` (in list order): a row's value is its copy in the last object
    holding it. Into ``out`` when given."""
    codes = apply_native(entries, parts, out=out)
    if codes is not None:
        return codes
    return apply_each(entries, parts, oid, out=out)


def apply_each(entries: Any, parts: Sequence[Object], oid: bytes, *,
               out: np.ndarray | None = None) -> np.ndarray:
    """``apply_list`` one object at a time, in list order (the reference)."""
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
        _, idx, _, got = decode_rows_object(part, ref, rates=False, head=head)
        assert idx is not None and got is not None
        codes[idx] = got
        covered[idx] = True
    assert codes is not None and covered is not None
    if not covered.all():
        raise ManifestError(f"block list leaves {int((~covered).sum())} rows with no copy",
                            oid=oid)
    return codes


_scratch = threading.local()
_SCRATCH_KEEP = 1 << 22  # rows: larger scratch is not kept between blocks


def _scratch_for(nrows: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(covered u8[nrows], ids int64[count]) of this thread, reused from block to block
    (no larger than the reference's own: it allocates a bool a row too)."""
    if max(nrows, count) > _SCRATCH_KEEP:  # zero pages: only the rows written are touched
        return np.zeros(nrows, dtype=np.uint8), np.empty(count, dtype=np.int64)
    got = getattr(_scratch, "bufs", None)
    if got is None or len(got[0]) < nrows or len(got[1]) < count:
        got = (np.empty(max(nrows, len(got[0]) if got else 0), dtype=np.uint8),
               np.empty(max(count, len(got[1]) if got else 0, 1), dtype=np.int64))
        _scratch.bufs = got
    covered = got[0][:nrows]
    covered.fill(0)
    return covered, got[1]


def apply_native(entries: Any, parts: Sequence[Object], *, out: np.ndarray | None = None
                 ) -> np.ndarray | None:
    """``apply_list`` by the kernel, or None where it is not loaded or does not apply the
    list (an object it refuses, a row with no copy, ``out`` not a C-contiguous uint8
    array of the block's shape): the caller then runs ``apply_each``."""
    kern = native.kernel()
    fn = kern.apply_rows if kern is not None else None
    n = len(parts)
    if fn is None or not n or not len(entries.refs) == len(entries.rows) == n:
        return None
    for part in parts:
        if part.kind != KIND_BLOCK_ROWS or part.refs:
            return None
    try:
        head = read_rows_header(parts[0])
    except ManifestError:
        return None
    # the block's shape is the first object's, once it matches its entry (as apply_each)
    if (head.count, head.cls, head.step) != (entries.rows[0], entries.cls[0],
                                             entries.steps[0]):
        return None
    most = int(np.max(entries.rows))
    shape = (head.nrows, head.row_nbytes)
    if most > head.nrows:
        return None  # an object of more rows than the block: refused
    codes = np.empty(shape, dtype=np.uint8) if out is None else out
    if (codes.shape != shape or codes.dtype != np.uint8 or not codes.flags.c_contiguous
            or not codes.flags.writeable):
        return None
    payloads = [part.payload for part in parts]
    keep: list[np.ndarray] = []
    if all(type(p) is bytes for p in payloads):
        ptrs: Any = (ctypes.c_char_p * n)(*payloads)
    else:  # memoryviews or bytearrays: their buffers' addresses
        keep = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
        ptrs = (ctypes.c_void_p * n)(*(a.ctypes.data if len(a) else None for a in keep))
    lens = np.fromiter(map(len, payloads), dtype=np.int64, count=n)
    want = [np.ascontiguousarray(x, dtype=np.int64)
            for x in (entries.rows, entries.cls, entries.steps)]
    covered, ids = _scratch_for(head.nrows, most)
    left = fn(ptrs, lens.ctypes.data, n, want[0].ctypes.data, want[1].ctypes.data,
              want[2].ctypes.data, head.nrows, head.row_nbytes,
              codes.ctypes.data, covered.ctypes.data,
              ids.ctypes.data)
    del keep
    return codes if left == 0 else None

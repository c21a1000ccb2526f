"""Row-block payloads: full blocks and patches, stored in element-plane order.

A block holds the encoded rows (``uint8[nrows, row_nbytes]``) of ``block_rows``
consecutive table rows. Payloads split the bytes of every *element* (4 for fp32 rows, 2 for
fp16/bf16, 1 for int codes: no split) into planes: byte 0 of every element, then byte 1, ...
Exponent bytes of floats then sit together, and the engine's zstd finds the redundancy that
element order hides (docs/MANIFEST.md, "Blocks"; measured there).

    FULL  = "CNRB" | version u8 | layout u8 | elem u16 | nrows u32 | row_nbytes u32 | planes
    PATCH = "CNRP" | version u8 | index_size u8 | elem u16 | nrows u32 | row_nbytes u32
            | nchanged u32 | indices (u16/u32 le, ascending) | planes of the changed rows

A patch refers to its base block (refs = [base]); ``resolve`` applies a chain, or a
block list (the grouped layout, below).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from cnrstore.errors import ManifestError
from engine import Object

__all__ = [
    "KIND_BLOCK_FULL",
    "KIND_BLOCK_PATCH",
    "BLOCK_VERSION",
    "BlockHeader",
    "encode_full",
    "encode_patch",
    "decode_full",
    "decode_patch",
    "read_header",
    "resolve",
    "plane_width",
    "plan_chain",
    "full_nbytes",
    "patch_max_nbytes",
    "KIND_BLOCK_ROWS",
    "KIND_BLOCK_LIST",
    "RowsHeader",
    "encode_rows",
    "decode_rows_object",
    "rows_nbytes",
    "encode_list",
    "decode_list",
    "plan_list",
    "resolve_list",
    "rate_code",
    "rate_value",
]

# Engine object kinds of blocks (docs/MANIFEST.md, "Object kinds"); manifest.py re-exports
# them with the node kinds, so blocks stay below the manifest in the layering.
KIND_BLOCK_FULL = 4
KIND_BLOCK_PATCH = 5
# The grouped layout (docs/design/diff-base.md, "Rows grouped by rate"): a block version
# is a list node (its refs: row objects, applied in list order). Kind 6 is the options
# object (cnrstore/core/options.py).
KIND_BLOCK_ROWS = 7
KIND_BLOCK_LIST = 8
BLOCK_VERSION = 2
LAYOUT_ELEMENT_PLANES = 2
_PLANE_WIDTHS = (1, 2, 4, 8)
_FULL = struct.Struct("<4sBBHII")
_PATCH = struct.Struct("<4sBBHIII")
_FULL_MAGIC = b"CNRB"
# Deepest patch chain a reader follows (writers keep chains to max_chain, 16 by default).
MAX_CHAIN = 1 << 16
_PATCH_MAGIC = b"CNRP"


@dataclass(frozen=True)
class BlockHeader:
    kind: int            # KIND_BLOCK_FULL or KIND_BLOCK_PATCH
    nrows: int           # rows of the block
    row_nbytes: int
    nchanged: int        # rows carried (nrows for a full block)
    header_size: int
    elem: int = 1        # bytes per element: the number of byte planes


def plane_width(scheme: str, itemsize: int, row_nbytes: int, *,
                exact_planes: bool = False) -> int:
    """Bytes per element of a scheme's codes: 1 (no split: rows as they are) for "exact"
    unless ``exact_planes`` (then the table's own), 2 for the 16-bit casts, 1 for integer
    codes, whose scale/offset are too few to matter. Exact rows unsplit are stored raw by
    the engine (zstd saves under its probe threshold on them), so a restore reads them
    straight into the table (docs/design/block-encoding.md, "Exact blocks")."""
    if scheme == "exact":
        k = itemsize if exact_planes else 1
    elif scheme in ("fp16", "bf16"):
        k = 2
    else:
        k = 1
    return k if k in _PLANE_WIDTHS and row_nbytes % k == 0 else 1


def _planes(codes: np.ndarray, elem: int) -> np.ndarray:
    # Splitting [elements, elem] into [elem, elements] is one strided copy that numpy runs
    # at ~1.3 GB/s here, 5x a transpose of whole rows (docs/MANIFEST.md, "Blocks").
    if elem == 1:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes.reshape(-1, elem).T)


def _unplanes(
    buf: memoryview | bytes, n: int, row_nbytes: int, elem: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Rows ``uint8[n, row_nbytes]`` from planes: into ``out`` (C-contiguous, that shape)
    when given, so a restore can decode straight into the table it returns."""
    flat = np.frombuffer(buf, dtype=np.uint8, count=n * row_nbytes)
    if out is None:
        out = np.empty((n, row_nbytes), dtype=np.uint8)  # writable: patches apply in place
    elif out.shape != (n, row_nbytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous uint8{[n, row_nbytes]}")
    if elem == 1:
        out[...] = flat.reshape(n, row_nbytes)
        return out
    planes = flat.reshape(elem, (n * row_nbytes) // elem)
    # One strided write per plane runs ~5x faster here than a transposing copy.
    dest = out.reshape(-1, elem)
    for k in range(elem):
        dest[:, k] = planes[k]
    return out


def _check_elem(elem: int, row_nbytes: int) -> None:
    if elem not in _PLANE_WIDTHS or row_nbytes % elem:
        raise ValueError(f"element width {elem} does not divide row_nbytes {row_nbytes}")


def _index_dtype(nrows: int) -> np.dtype:
    return np.dtype("<u2") if nrows <= 1 << 16 else np.dtype("<u4")


def encode_full(codes: np.ndarray, *, elem: int = 1) -> bytes:
    """Payload of a full block from its encoded rows ``uint8[nrows, row_nbytes]`` whose
    elements are ``elem`` bytes wide (``plane_width``)."""
    if codes.dtype != np.uint8 or codes.ndim != 2:
        raise ValueError(f"block codes must be uint8[nrows, row_nbytes], got {codes.dtype}")
    n, rnb = codes.shape
    _check_elem(elem, rnb)
    head = _FULL.pack(_FULL_MAGIC, BLOCK_VERSION, LAYOUT_ELEMENT_PLANES, elem, n, rnb)
    return b"".join((head, _planes(codes, elem).data))


def encode_patch(nrows: int, index: np.ndarray, codes: np.ndarray, *, elem: int = 1) -> bytes:
    """Payload of a patch replacing rows ``index`` (ascending, unique, < nrows) of a block of
    ``nrows`` rows with ``codes`` (``uint8[len(index), row_nbytes]``)."""
    if codes.dtype != np.uint8 or codes.ndim != 2 or len(index) != codes.shape[0]:
        raise ValueError("patch codes must be uint8[len(index), row_nbytes]")
    _check_elem(elem, codes.shape[1])
    idt = _index_dtype(nrows)
    idx = np.asarray(index).astype(idt, copy=False)
    head = _PATCH.pack(
        _PATCH_MAGIC, BLOCK_VERSION, idt.itemsize, elem, nrows, codes.shape[1], len(idx)
    )
    return b"".join((head, idx.tobytes(), _planes(codes, elem).data))


def patch_nbytes(nrows: int, nchanged: int, row_nbytes: int) -> int:
    """Payload size of a patch, without building it (the writer's chain bound)."""
    return _PATCH.size + nchanged * (_index_dtype(nrows).itemsize + row_nbytes)


def full_nbytes(nrows: int, row_nbytes: int) -> int:
    """Payload size of a full block of ``nrows`` rows: exactly this, never more."""
    return _FULL.size + nrows * row_nbytes


def patch_max_nbytes(nrows: int, row_nbytes: int) -> int:
    """The largest patch of a block of ``nrows`` rows (one replacing every row); a chain's
    patches together take no more (writers keep them within ``nrows * row_nbytes``)."""
    return patch_nbytes(nrows, nrows, row_nbytes)


def plan_chain(info: Callable[[bytes], Any], oid: bytes, nrows: int, row_nbytes: int, *,
               max_depth: int = MAX_CHAIN) -> None:
    """Check block ``oid``'s chain from the index alone before any of it is read:
    ``info(oid)`` gives (at least) ``kind``, ``refs`` and ``raw_len`` (an ObjectInfo or a
    RecordLocation). Each patch at most ``patch_max_nbytes``, all of them together too,
    the full block at the bottom exactly ``full_nbytes`` of the rows the table gives this
    block (docs/MANIFEST.md, "Memory caps"); ManifestError naming the object otherwise. The
    engine refuses a record whose header claims another length than its index entry, so
    nothing larger than planned is ever decompressed."""
    patch_max, total, cur = patch_max_nbytes(nrows, row_nbytes), 0, oid
    for _ in range(max_depth + 1):
        got = info(cur)
        if got.kind == KIND_BLOCK_LIST and cur == oid:
            plan_list(info, oid, nrows, row_nbytes)
            return
        if got.kind == KIND_BLOCK_FULL:
            want = full_nbytes(nrows, row_nbytes)
            if got.raw_len != want:
                raise ManifestError(
                    f"full block {cur.hex()} has a {got.raw_len}-byte payload; {nrows} rows "
                    f"of {row_nbytes} bytes take {want}", oid=cur)
            return
        if got.kind != KIND_BLOCK_PATCH or len(got.refs) != 1:
            raise ManifestError(f"object {cur.hex()} of kind {got.kind} is not a block",
                                oid=cur)
        total += got.raw_len
        if total > patch_max:
            raise ManifestError(
                f"patch {cur.hex()} brings the patches of block {oid.hex()} to {total} "
                f"bytes; patches of {nrows} rows of {row_nbytes} bytes take at most "
                f"{patch_max}", oid=cur)
        cur = got.refs[0]
    raise ManifestError(f"patch chain of block {oid.hex()} is deeper than {max_depth} "
                        "(cycle?)", oid=oid)


def read_header(obj: Object, oid: bytes | None = None) -> BlockHeader:
    """Parse and check a block's header (cheap; used by verify and inspection tools)."""
    p = obj.payload
    if obj.kind == KIND_BLOCK_FULL:
        if len(p) < _FULL.size:
            raise ManifestError("full block shorter than its header", oid=oid)
        magic, ver, layout, elem, n, rnb = _FULL.unpack_from(p)
        if magic != _FULL_MAGIC or ver != BLOCK_VERSION or layout != LAYOUT_ELEMENT_PLANES:
            raise ManifestError(f"full block has bad magic/version {magic!r}/{ver}", oid=oid)
        head = BlockHeader(KIND_BLOCK_FULL, n, rnb, n, _FULL.size, elem)
        body = n * rnb
    elif obj.kind == KIND_BLOCK_PATCH:
        if len(p) < _PATCH.size:
            raise ManifestError("patch block shorter than its header", oid=oid)
        magic, ver, isz, elem, n, rnb, k = _PATCH.unpack_from(p)
        if magic != _PATCH_MAGIC or ver != BLOCK_VERSION or isz != _index_dtype(n).itemsize:
            raise ManifestError(f"patch block has bad magic/version {magic!r}/{ver}", oid=oid)
        if len(obj.refs) != 1:
            raise ManifestError("patch block must refer to exactly one base", oid=oid)
        head = BlockHeader(KIND_BLOCK_PATCH, n, rnb, k, _PATCH.size, elem)
        body = k * (isz + rnb)
    else:
        raise ManifestError(f"object kind {obj.kind} is not a block", oid=oid)
    if head.elem not in _PLANE_WIDTHS or head.row_nbytes % head.elem:
        raise ManifestError(f"block element width {head.elem} is invalid", oid=oid)
    if len(p) != head.header_size + body:
        raise ManifestError(
            f"block payload is {len(p)} bytes, its header says {head.header_size + body}", oid=oid
        )
    return head


def decode_full(obj: Object, oid: bytes | None = None, *, out: np.ndarray | None = None
                ) -> np.ndarray:
    head = read_header(obj, oid)
    if head.kind != KIND_BLOCK_FULL:
        raise ManifestError("expected a full block", oid=oid)
    if out is not None and out.shape != (head.nrows, head.row_nbytes):
        raise ManifestError(
            f"block holds {(head.nrows, head.row_nbytes)} codes, expected {out.shape}", oid=oid
        )
    return _unplanes(
        memoryview(obj.payload)[head.header_size:], head.nrows, head.row_nbytes, head.elem, out
    )


def decode_patch(
    obj: Object, oid: bytes | None = None
) -> tuple[BlockHeader, np.ndarray, np.ndarray]:
    """(header, row indices int64, codes uint8[nchanged, row_nbytes]) of a patch; the
    codes may be a read-only view of ``obj``'s payload."""
    head = read_header(obj, oid)
    if head.kind != KIND_BLOCK_PATCH:
        raise ManifestError("expected a patch block", oid=oid)
    idt = _index_dtype(head.nrows)
    view = memoryview(obj.payload)[head.header_size:]
    idx = np.frombuffer(view, dtype=idt, count=head.nchanged).astype(np.int64)
    if head.nchanged and (idx[-1] >= head.nrows or np.any(np.diff(idx) <= 0)):
        raise ManifestError("patch row indices are out of range or not ascending", oid=oid)
    rows = view[head.nchanged * idt.itemsize:]
    if head.elem == 1:  # rows as stored: a read-only view of the payload, not a copy
        codes = np.frombuffer(rows, dtype=np.uint8, count=head.nchanged * head.row_nbytes)
        return head, idx, codes.reshape(head.nchanged, head.row_nbytes)
    return head, idx, _unplanes(rows, head.nchanged, head.row_nbytes, head.elem)


def _direct(get_into: Callable, oid: bytes, out: np.ndarray) -> Object | None:
    """Read full block ``oid`` straight into ``out`` when the engine can (rows unsplit,
    stored raw): None. Otherwise the object, read as ``get`` reads it (``out``
    untouched): a patch, or a block to decode."""
    view = memoryview(out).cast("B")  # type: ignore[arg-type]  # ndarray exports a buffer
    head = get_into(oid, KIND_BLOCK_FULL, _FULL.size, view, fallback=True)
    if isinstance(head, Object):
        return head
    magic, ver, layout, elem, n, rnb = _FULL.unpack(head)
    if (magic, ver, layout) != (_FULL_MAGIC, BLOCK_VERSION, LAYOUT_ELEMENT_PLANES):
        raise ManifestError(f"full block has bad magic/version {magic!r}/{ver}", oid=oid)
    if (n, rnb) != out.shape:
        raise ManifestError(f"block holds {(n, rnb)} codes, expected {out.shape}", oid=oid)
    if elem != 1:
        # Same size, other layout: the planes were read in; reorder them in place.
        _check_elem(elem, rnb)
        _unplanes(out.tobytes(), n, rnb, elem, out)
    return None


def resolve(
    get: Callable[[bytes], Object],
    oid: bytes,
    *,
    max_depth: int = MAX_CHAIN,
    out: np.ndarray | None = None,
    get_into: Callable | None = None,
    info: Callable[[bytes], Any] | None = None,
    shape: tuple[int, int] | None = None,
) -> np.ndarray:
    """Encoded rows of block ``oid``: follow patch refs down to the full block, then apply
    the patches oldest first. ``get`` reads an object (e.g. ``store.get``). With ``out``
    (uint8, the block's shape) the rows are decoded into it; with ``get_into`` too
    (``store.get_into``) a full block stored raw is read straight into ``out``. With
    ``info`` (``store.info``) and ``shape`` (rows, row_nbytes: what the table gives the
    block) the chain's sizes are checked first (``plan_chain``), before any read."""
    if info is not None and shape is not None:
        plan_chain(info, oid, *shape, max_depth=max_depth)
    chain: list[tuple[bytes, Object]] = []
    cur = oid
    into = get_into if (out is not None and out.flags.c_contiguous and out.dtype == np.uint8
                        and out.ndim == 2 and out.size) else None
    codes: np.ndarray
    while True:
        if into is not None and out is not None:
            got = _direct(into, cur, out)
            if got is None:
                codes = out
                break
            obj = got
        else:
            obj = get(cur)
        if obj.kind == KIND_BLOCK_FULL:
            codes = decode_full(obj, cur, out=out)
            break
        if obj.kind == KIND_BLOCK_LIST and not chain:
            return resolve_list(get, cur, obj, out=out)
        chain.append((cur, obj))
        if len(chain) > max_depth:
            raise ManifestError("patch chain too deep (cycle?)", oid=oid)
        if obj.kind != KIND_BLOCK_PATCH or len(obj.refs) != 1:
            raise ManifestError(f"object kind {obj.kind} is not a block", oid=cur)
        cur = obj.refs[0]
    for poid, pobj in reversed(chain):
        head, idx, rows = decode_patch(pobj, poid)
        if (head.nrows, head.row_nbytes) != codes.shape:
            raise ManifestError("patch does not match its base block's shape", oid=poid)
        codes[idx] = rows
    return codes


# ---- The grouped layout: row objects and block list nodes ---------------------------------
#
#     ROWS = "CNRR" | version u8 | ids u8 | elem u8 | rated u8 | nrows u32 | row_nbytes u32
#            | count u32 | start u32 | step i64 | cls u8 | 3 pad
#            | row ids (none: the span [start, start + count); u16/u32 le ascending; or a
#              bitmap of the block's rows, lsb first) | rates u8[count] if rated | planes
#     LIST = msgpack {"v": 1, "cls": u8[k], "rows": u32[k], "step": i64[k]} (bin fields),
#            refs = the k row objects in the order they apply
#
# A row's value is its copy in the last listed object that holds it. The step is in the
# row object, so objects of different steps never share an id: a block written fresh over
# a damaged object never dedups onto it. Each row's change rate at its write (rate_code)
# rides with its copy, so a handle reopened on the store rebuilds exactly the writer state
# of one that never closed (cnrstore/core/grouppolicy.py), and ids do not depend on it.

_ROWS = struct.Struct("<4sBBBBIIIIqB3x")
_ROWS_MAGIC = b"CNRR"
IDS_SPAN, IDS_U16, IDS_U32, IDS_BITMAP = 0, 1, 2, 3
_LIST_VERSION = 1
_LIST_ENTRY_BYTES = 13       # u8 class + u32 rows + i64 step, per listed object
_LIST_HEAD_BYTES = 64
# A listed version may read at most this many times its block's bytes (writers clean to
# ~1.5x, cnrstore/core/grouppolicy.py): a crafted list is refused from the index.
LIST_READ_CAP = 4


@dataclass(frozen=True)
class RowsHeader:
    nrows: int           # rows of the block the object belongs to
    row_nbytes: int
    count: int           # rows carried
    start: int           # first row of a span object (ids == IDS_SPAN)
    ids: int             # IDS_SPAN, IDS_U16, IDS_U32 or IDS_BITMAP
    rated: bool
    step: int
    cls: int
    elem: int
    header_size: int


def rate_code(rate: np.ndarray) -> np.ndarray:
    """u8 codes of change rates in [0, 1]: 2^(-k/16) for k in 0..254, 255 for 0 (below
    2^-15.9). Relative steps of 4.4%: far finer than the classes' thresholds."""
    r = np.asarray(rate, dtype=np.float64)
    with np.errstate(divide="ignore"):
        k = np.rint(-16.0 * np.log2(np.maximum(r, 1e-300)))
    return np.where(r > 2.0 ** (-254.5 / 16), np.clip(k, 0, 254), 255).astype(np.uint8)


def rate_value(code: np.ndarray) -> np.ndarray:
    """The rates ``rate_code`` codes stand for (float64)."""
    c = np.asarray(code).astype(np.float64)
    return np.where(c >= 255, 0.0, np.exp2(-c / 16.0))


def _ids_size(mode: int, nrows: int, count: int) -> int:
    if mode == IDS_SPAN:
        return 0
    if mode == IDS_BITMAP:
        return -(-nrows // 8)
    return count * (2 if mode == IDS_U16 else 4)


def _ids_mode(nrows: int, count: int) -> int:
    wide = IDS_U16 if nrows <= 1 << 16 else IDS_U32
    return IDS_BITMAP if _ids_size(IDS_BITMAP, nrows, count) < _ids_size(wide, nrows, count) \
        else wide


def rows_nbytes(nrows: int, count: int, row_nbytes: int, *, span: bool = False,
                rated: bool = True) -> int:
    """Payload size of a row object, without building it (the writer's read estimate)."""
    mode = IDS_SPAN if span else _ids_mode(nrows, count)
    return (_ROWS.size + _ids_size(mode, nrows, count) + (count if rated else 0)
            + count * row_nbytes)


def encode_rows(nrows: int, codes: np.ndarray, *, step: int, cls: int, elem: int = 1,
                index: np.ndarray | None = None, start: int = 0,
                rates: np.ndarray | None = None) -> bytes:
    """Payload of a row object of a block of ``nrows`` rows: ``codes``
    (``uint8[count, row_nbytes]``) are rows ``index`` (ascending, unique, < nrows) or,
    with ``index`` None, the span from ``start``. ``rates``: u8 rate codes of the rows
    (None: all zero, the full put's chunks)."""
    if codes.dtype != np.uint8 or codes.ndim != 2:
        raise ValueError("row codes must be uint8[count, row_nbytes]")
    count, rnb = codes.shape
    _check_elem(elem, rnb)
    if index is None:
        mode, ids = IDS_SPAN, b""
        if start < 0 or start + count > nrows:
            raise ValueError("span past the block")
    else:
        if len(index) != count:
            raise ValueError("row ids and codes differ in length")
        start = 0
        mode = _ids_mode(nrows, count)
        idx = np.asarray(index, dtype=np.int64)
        if mode == IDS_BITMAP:
            bits = np.zeros(nrows, dtype=bool)
            bits[idx] = True
            ids = np.packbits(bits, bitorder="little").tobytes()
        else:
            ids = idx.astype("<u2" if mode == IDS_U16 else "<u4").tobytes()
    rated = rates is not None
    if rates is not None and len(rates) != count:
        raise ValueError("rates and codes differ in length")
    head = _ROWS.pack(_ROWS_MAGIC, BLOCK_VERSION, mode, elem, int(rated), nrows, rnb, count,
                      start, step, cls)
    parts = [head, ids]
    if rated:
        parts.append(np.asarray(rates, dtype=np.uint8).tobytes())
    parts.append(_planes(codes, elem).data)  # type: ignore[arg-type]
    return b"".join(parts)


def read_rows_header(obj: Object, oid: bytes | None = None) -> RowsHeader:
    """Parse and check a row object's header and size."""
    p = obj.payload
    if obj.kind != KIND_BLOCK_ROWS or obj.refs:
        raise ManifestError(f"object kind {obj.kind} is not a row object", oid=oid)
    if len(p) < _ROWS.size:
        raise ManifestError("row object shorter than its header", oid=oid)
    magic, ver, mode, elem, rated, n, rnb, count, start, step, cls = _ROWS.unpack_from(p)
    if magic != _ROWS_MAGIC or ver != BLOCK_VERSION or mode > IDS_BITMAP or rated > 1:
        raise ManifestError(f"row object has bad magic/version {magic!r}/{ver}", oid=oid)
    if elem not in _PLANE_WIDTHS or rnb % elem or count > n or (
            mode == IDS_SPAN and start + count > n) or (mode == IDS_U16 and n > 1 << 16):
        raise ManifestError("row object header is invalid", oid=oid)
    head = RowsHeader(n, rnb, count, start, mode, bool(rated), step, cls, elem, _ROWS.size)
    want = _ROWS.size + _ids_size(mode, n, count) + (count if rated else 0) + count * rnb
    if len(p) != want:
        raise ManifestError(f"row object is {len(p)} bytes, its header says {want}", oid=oid)
    return head


def decode_rows_object(obj: Object, oid: bytes | None = None, *, codes: bool = True
                       ) -> tuple[RowsHeader, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(header, row ids int64 (None for a span: see header.start), rate codes u8,
    codes ``uint8[count, row_nbytes]`` (None unless ``codes``; maybe a read-only view))."""
    head = read_rows_header(obj, oid)
    view = memoryview(obj.payload)[head.header_size:]
    n, count = head.nrows, head.count
    idx: np.ndarray | None = None
    size = _ids_size(head.ids, n, count)
    if head.ids == IDS_BITMAP:
        bits = np.unpackbits(np.frombuffer(view, dtype=np.uint8, count=size),
                             bitorder="little")[:n]
        idx = np.flatnonzero(bits).astype(np.int64)
        if len(idx) != count:
            raise ManifestError("row object bitmap holds another row count", oid=oid)
    elif head.ids != IDS_SPAN:
        dt = "<u2" if head.ids == IDS_U16 else "<u4"
        idx = np.frombuffer(view, dtype=dt, count=count).astype(np.int64)
        if count and (idx[-1] >= n or np.any(np.diff(idx) <= 0)):
            raise ManifestError("row object ids are out of range or not ascending", oid=oid)
    view = view[size:]
    if head.rated:
        rates = np.frombuffer(view, dtype=np.uint8, count=count)
        view = view[count:]
    else:
        rates = np.full(count, 255, dtype=np.uint8)
    rows: np.ndarray | None = None
    if codes:
        if head.elem == 1:
            rows = np.frombuffer(view, dtype=np.uint8, count=count * head.row_nbytes
                                 ).reshape(count, head.row_nbytes)
        else:
            rows = _unplanes(view, count, head.row_nbytes, head.elem)
    return head, idx, rates, rows


def encode_list(refs: tuple[bytes, ...], cls: np.ndarray, rows: np.ndarray,
                steps: np.ndarray) -> tuple[bytes, tuple[bytes, ...]]:
    """(payload, refs) of a block's list node: its row objects in the order they apply,
    with each one's class, row count and step."""
    if not len(refs) == len(cls) == len(rows) == len(steps):
        raise ValueError("list entries differ in length")
    doc = {"v": _LIST_VERSION, "cls": np.asarray(cls, dtype=np.uint8).tobytes(),
           "rows": np.asarray(rows, dtype="<u4").tobytes(),
           "step": np.asarray(steps, dtype="<i8").tobytes()}
    return msgpack.packb(doc, use_bin_type=True), tuple(refs)


def _list_cap(nrefs: int) -> int:
    return _LIST_HEAD_BYTES + _LIST_ENTRY_BYTES * nrefs


def decode_list(obj: Object, oid: bytes | None = None
                ) -> tuple[tuple[bytes, ...], np.ndarray, np.ndarray, np.ndarray]:
    """(refs, classes u8, row counts int64, steps int64) of a list node."""
    if obj.kind != KIND_BLOCK_LIST:
        raise ManifestError(f"object kind {obj.kind} is not a block list", oid=oid)
    k = len(obj.refs)
    if len(obj.payload) > _list_cap(k):
        raise ManifestError("block list payload is larger than its entries take", oid=oid)
    try:
        doc = msgpack.unpackb(obj.payload, raw=False, max_array_len=0, max_map_len=8,
                              max_str_len=16, max_bin_len=8 * k + 8)
        if not isinstance(doc, dict) or doc.get("v") != _LIST_VERSION:
            raise ValueError("bad version")
        cls = np.frombuffer(doc["cls"], dtype=np.uint8)
        rows = np.frombuffer(doc["rows"], dtype="<u4").astype(np.int64)
        steps = np.frombuffer(doc["step"], dtype="<i8").astype(np.int64)
    except Exception as exc:  # msgpack and numpy raise several unrelated types
        raise ManifestError(f"malformed block list: {exc}", oid=oid) from None
    if not len(cls) == len(rows) == len(steps) == k:
        raise ManifestError("block list entries and refs differ in length", oid=oid)
    return tuple(obj.refs), cls, rows, steps


def plan_list(info: Callable[[bytes], Any], oid: bytes, nrows: int, row_nbytes: int) -> None:
    """``plan_chain`` for a list node: every listed object a row object of at most a
    whole block's rows, all of them together within LIST_READ_CAP block bytes, checked
    in the index before any is read."""
    got = info(oid)
    if got.kind != KIND_BLOCK_LIST or got.raw_len > _list_cap(len(got.refs)):
        raise ManifestError(f"object {oid.hex()} is not a block list of its size", oid=oid)
    one = rows_nbytes(nrows, nrows, row_nbytes)
    cap = LIST_READ_CAP * full_nbytes(nrows, row_nbytes) + len(got.refs) * _ROWS.size
    total = 0
    for ref in got.refs:
        r = info(ref)
        if r.kind != KIND_BLOCK_ROWS or r.raw_len > one:
            raise ManifestError(f"object {ref.hex()} listed by block {oid.hex()} is not a "
                                f"row object of {nrows} rows", oid=ref)
        total += r.raw_len
        if total > cap:
            raise ManifestError(f"block list {oid.hex()} lists more than {cap} bytes",
                                oid=oid)


def resolve_list(get: Callable[[bytes], Object], oid: bytes, obj: Object | None = None, *,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Encoded rows of the block whose version is list node ``oid``: its objects applied
    in list order (into ``out`` when given). ManifestError when an object does not fit
    its entry or the block, or a row has no copy."""
    node = get(oid) if obj is None else obj
    refs, cls, rows, steps = decode_list(node, oid)
    if not refs:
        raise ManifestError("block list is empty", oid=oid)
    codes = out
    covered: np.ndarray | None = None
    for k, ref in enumerate(refs):
        part = get(ref)
        head = read_rows_header(part, ref)
        if (head.count, head.cls, head.step) != (rows[k], cls[k], steps[k]):
            raise ManifestError(f"row object {ref.hex()} does not match its list entry",
                                oid=oid)
        if codes is None:
            codes = np.empty((head.nrows, head.row_nbytes), dtype=np.uint8)
        if covered is None:
            covered = np.zeros(len(codes), dtype=bool)
        if (head.nrows, head.row_nbytes) != codes.shape:
            raise ManifestError("row object does not match its block's shape", oid=ref)
        if head.ids == IDS_SPAN and head.elem != 1:
            view = memoryview(part.payload)[head.header_size + (head.count if head.rated
                                                                else 0):]
            _unplanes(view, head.count, head.row_nbytes, head.elem,
                      codes[head.start:head.start + head.count])
            covered[head.start:head.start + head.count] = True
            continue
        _, idx, _, got = decode_rows_object(part, ref)
        assert got is not None
        if idx is None:
            codes[head.start:head.start + head.count] = got
            covered[head.start:head.start + head.count] = True
        else:
            codes[idx] = got
            covered[idx] = True
    assert codes is not None and covered is not None
    if not covered.all():
        raise ManifestError(f"block list leaves {int((~covered).sum())} rows with no copy",
                            oid=oid)
    return codes

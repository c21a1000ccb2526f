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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cnrstore.errors import ManifestError
from cnrstore.format.planes import PLANE_WIDTHS, check_elem, planes, unplanes
from cnrstore.format.rowlists import (
    KIND_BLOCK_LIST,
    KIND_BLOCK_ROWS,
    plan_list,
    resolve_list,
)
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
]

# Engine object kinds of blocks (docs/MANIFEST.md, "Object kinds"); manifest.py re-exports
# them with the node kinds, so blocks stay below the manifest in the layering.
KIND_BLOCK_FULL = 4
KIND_BLOCK_PATCH = 5
# KIND_BLOCK_ROWS = 7 and KIND_BLOCK_LIST = 8 (the grouped layout) come from rowlists.py;
# kind 6 is the options object (cnrstore/core/options.py).
BLOCK_VERSION = 2
LAYOUT_ELEMENT_PLANES = 2
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
    return k if k in PLANE_WIDTHS and row_nbytes % k == 0 else 1


def _index_dtype(nrows: int) -> np.dtype:
    return np.dtype("<u2") if nrows <= 1 << 16 else np.dtype("<u4")


def encode_full(codes: np.ndarray, *, elem: int = 1) -> bytes:
    """Payload of a full block from its encoded rows ``uint8[nrows, row_nbytes]`` whose
    elements are ``elem`` bytes wide (``plane_width``)."""
    if codes.dtype != np.uint8 or codes.ndim != 2:
        raise ValueError(f"block codes must be uint8[nrows, row_nbytes], got {codes.dtype}")
    n, rnb = codes.shape
    check_elem(elem, rnb)
    head = _FULL.pack(_FULL_MAGIC, BLOCK_VERSION, LAYOUT_ELEMENT_PLANES, elem, n, rnb)
    return b"".join((head, planes(codes, elem).data))


def encode_patch(nrows: int, index: np.ndarray, codes: np.ndarray, *, elem: int = 1) -> bytes:
    """Payload of a patch replacing rows ``index`` (ascending, unique, < nrows) of a block of
    ``nrows`` rows with ``codes`` (``uint8[len(index), row_nbytes]``)."""
    if codes.dtype != np.uint8 or codes.ndim != 2 or len(index) != codes.shape[0]:
        raise ValueError("patch codes must be uint8[len(index), row_nbytes]")
    check_elem(elem, codes.shape[1])
    idt = _index_dtype(nrows)
    idx = np.asarray(index).astype(idt, copy=False)
    head = _PATCH.pack(
        _PATCH_MAGIC, BLOCK_VERSION, idt.itemsize, elem, nrows, codes.shape[1], len(idx)
    )
    return b"".join((head, idx.tobytes(), planes(codes, elem).data))


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
    if head.elem not in PLANE_WIDTHS or head.row_nbytes % head.elem:
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
    return unplanes(
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
    return head, idx, unplanes(rows, head.nchanged, head.row_nbytes, head.elem)


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
        check_elem(elem, rnb)
        unplanes(out.tobytes(), n, rnb, elem, out)
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
    get_many: Callable[[Sequence[bytes]], Sequence[Object]] | None = None,
) -> np.ndarray:
    """Encoded rows of block ``oid``: follow patch refs down to the full block, then apply
    the patches oldest first. ``get`` reads an object (e.g. ``store.get``). With ``out``
    (uint8, the block's shape) the rows are decoded into it; with ``get_into`` too
    (``store.get_into``) a full block stored raw is read straight into ``out``. With
    ``info`` (``store.info``) and ``shape`` (rows, row_nbytes: what the table gives the
    block) the chain's sizes are checked first (``plan_chain``), before any read. A list
    node (the grouped layout) reads its row objects with ``get_many`` where given
    (``rowlists.resolve_list``)."""
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
            return resolve_list(get, cur, obj, out=out, get_many=get_many)
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

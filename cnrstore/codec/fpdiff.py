"""Row fingerprints and the rows whose fingerprint changed since the previous put, together.

An incremental put needs both: the new fingerprints (the next put's diff base) and the
ascending ids of the rows that differ from the stored ones. Computed apart, the
fingerprint array is written, then read again beside the old one for the compare, and
the boolean mask is written and scanned for its set entries: three passes over arrays
of the table's row count, on the caller's thread (the stall of a non-blocking put, issue
27). The compiled kernel (cnr_row_fingerprints_diff) compares each row's fingerprint as
it is made and emits the changed ids in the same pass, on every core for a large table
as ``row_fingerprints`` does. Elsewhere (no kernel, a CUDA table, rows that are not one
dense run) it is ``row_fingerprints`` and a compare, which give the same answer.

A put whose caller tracked the touched rows (``touched_changes``) hashes those rows where
they lie (cnr_touched_fingerprints_diff) and writes only the changed ones' fingerprints
into the new base: apart, the touched rows were copied by index_select, hashed, and the
old fingerprints gathered and compared (1.4-3.1 ms against 0.8-1.2 ms for 25 k rows of 256
B out of 500 k, docs/design/put-speed.md).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cnrstore.codec import fingerprint as fpm
from cnrstore.codec import native

__all__ = ["fingerprints_and_changes", "gathered_changes", "touched_changes"]

# Touched rows of at least this many bytes are hashed in parts on every core: scattered
# rows wait on memory, not on the multiplies, so the split pays from far fewer bytes
# than a dense pass (fingerprint.py _SPLIT_MIN_BYTES).
_SPLIT_TOUCHED_BYTES = 4 << 20


def fingerprints_and_changes(x: torch.Tensor, old: torch.Tensor
                             ) -> tuple[torch.Tensor, np.ndarray]:
    """(``row_fingerprints(x)``, int64 ids of the rows r < len(old) whose fingerprint is
    not ``old[r]``, ascending). ``x``: rows are dim 0; ``old``: int64 [<= rows] on any
    device."""
    rows = x.shape[0]
    common = min(rows, old.shape[0])
    got = _native(x, old[:common], common)
    if got is not None:
        return got
    fp = fpm.row_fingerprints(x)
    mask = fp[:common] != old[:common].to(fp.device)
    return fp, torch.nonzero(mask).flatten().cpu().numpy()


def touched_changes(x: torch.Tensor, t: torch.Tensor, fp: torch.Tensor) -> np.ndarray:
    """The touched rows ``t`` (int64, ascending, distinct, each < len(fp)) of ``x`` whose
    fingerprint differs from ``fp[t]``, ascending (int64 numpy); ``fp`` (int64, on x's
    device) gets their new fingerprints in place. A tracker reports the rows it saw looked
    up, and a looked-up row need not have changed."""
    if not t.numel():
        return np.zeros(0, dtype=np.int64)
    got = _native_touched(x, t, fp)
    if got is not None:
        return got
    # index_select, not x[t]: advanced indexing of a [rows, 64] float32 table took ~7x as
    # long for the same rows (0.35 ms against 0.05 ms for 8000, one thread).
    return gathered_changes(torch.index_select(x, 0, t), t, fp)


def gathered_changes(rows: torch.Tensor, t: torch.Tensor, fp: torch.Tensor) -> np.ndarray:
    """``touched_changes`` of touched rows already gathered: ``rows[i]`` is table row
    ``t[i]`` (a copy taken in a put's stall, or index_select)."""
    now = fpm.row_fingerprints(rows)
    differ = now != torch.index_select(fp, 0, t)
    fp.index_copy_(0, t[differ], now[differ])
    return t[differ].cpu().numpy()


def _dense_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """(``x`` as [rows, row elements], row bytes, 8-byte words a row) for the kernels: a
    CPU tensor whose rows' elements are each one dense run (rows any stride apart);
    None otherwise."""
    if (x.device.type != "cpu" or x.is_quantized or x.layout != torch.strided
            or x.ndim < 1):
        return None
    try:
        flat = x.view(x.shape[0], math.prod(x.shape[1:]))
    except RuntimeError:  # the row's elements are not one dense run
        return None
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        return None
    nbytes = fpm._row_nbytes(x)
    return flat, nbytes, (nbytes + 7) // 8


def _native_touched(x: torch.Tensor, t: torch.Tensor, fp: torch.Tensor) -> np.ndarray | None:
    kernels = native.kernel()
    dense = _dense_rows(x)
    if (kernels is None or kernels.touched_diff is None or dense is None
            or fp.device.type != "cpu" or not fp.is_contiguous() or fp.dtype != torch.int64):
        return None
    flat, nbytes, words = dense
    ids = np.ascontiguousarray(t.numpy(), dtype=np.int64)
    a, b = fpm._keys(x.device, words)
    row_bytes = flat.stride(0) * flat.element_size()
    len_mix = (nbytes * fpm._LEN_MUL) & fpm._MASK64
    base, fp_ptr, ip = flat.data_ptr(), fp.data_ptr(), ids.ctypes.data

    def part(lo: int, hi: int) -> np.ndarray:  # touched rows ids[lo:hi]
        changed = np.empty(max(hi - lo, 1), dtype=np.int64)  # touched only as filled
        k = kernels.touched_diff(base, row_bytes, nbytes, a.data_ptr(), b.data_ptr(),
                                 len_mix, ip + 8 * lo, hi - lo, fp_ptr, changed.ctypes.data)
        return changed[:k]

    parts = min(fpm._cores(), len(ids)) if len(ids) * nbytes >= _SPLIT_TOUCHED_BYTES else 1
    found = fpm.in_parts(len(ids), parts, part)
    return np.concatenate(found)


def _native(x: torch.Tensor, old: torch.Tensor, common: int
            ) -> tuple[torch.Tensor, np.ndarray] | None:
    kernels = native.kernel()
    dense = _dense_rows(x)
    if kernels is None or kernels.fingerprint_diff is None or dense is None:
        return None
    flat, nbytes, words = dense
    n = x.shape[0]
    out = torch.empty(n, dtype=torch.int64)
    if n == 0:
        return out, np.zeros(0, dtype=np.int64)
    oldc = old.to("cpu", torch.int64).contiguous()
    a, b = fpm._keys(x.device, words)
    row_bytes = flat.stride(0) * flat.element_size()
    len_mix = (nbytes * fpm._LEN_MUL) & fpm._MASK64
    base, o_ptr, old_ptr = flat.data_ptr(), out.data_ptr(), oldc.data_ptr()

    def part(lo: int, hi: int) -> np.ndarray:
        compare = max(0, min(common, hi) - lo)
        changed = np.empty(max(compare, 1), dtype=np.int64)  # touched only as filled
        k = kernels.fingerprint_diff(
            base + lo * row_bytes, hi - lo, row_bytes, nbytes, a.data_ptr(), b.data_ptr(),
            len_mix, o_ptr + 8 * lo, old_ptr + 8 * min(lo, common), compare,
            changed.ctypes.data)
        return changed[:k] + lo

    found = fpm.in_parts(n, fpm._split_parts(x.device, n, nbytes), part)
    return out, np.concatenate(found)

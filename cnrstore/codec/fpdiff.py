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
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cnrstore.codec import fingerprint as fpm
from cnrstore.codec import native

__all__ = ["fingerprints_and_changes"]


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


def _native(x: torch.Tensor, old: torch.Tensor, common: int
            ) -> tuple[torch.Tensor, np.ndarray] | None:
    kernels = native.kernel()
    if kernels is None or kernels.fingerprint_diff is None or x.device.type != "cpu":
        return None
    if x.is_quantized or x.layout != torch.strided or x.ndim < 1:
        return None
    n = x.shape[0]
    try:
        flat = x.view(n, math.prod(x.shape[1:]))
    except RuntimeError:  # the row's elements are not one dense run
        return None
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        return None
    nbytes = fpm._row_nbytes(x)
    words = (nbytes + 7) // 8
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

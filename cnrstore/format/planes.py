"""Element planes: the byte order every block payload stores its rows' codes in (byte 0
of every element, then byte 1, ...; docs/MANIFEST.md, "Blocks"). Shared by full blocks
and patches (blocks.py) and the grouped layout's row objects (rowlists.py)."""

from __future__ import annotations

import numpy as np

__all__ = ["PLANE_WIDTHS", "planes", "unplanes", "check_elem"]

PLANE_WIDTHS = (1, 2, 4, 8)


def planes(codes: np.ndarray, elem: int) -> np.ndarray:
    # Splitting [elements, elem] into [elem, elements] is one strided copy that numpy runs
    # at ~1.3 GB/s here, 5x a transpose of whole rows (docs/MANIFEST.md, "Blocks").
    if elem == 1:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes.reshape(-1, elem).T)


def unplanes(
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


def check_elem(elem: int, row_nbytes: int) -> None:
    if elem not in PLANE_WIDTHS or row_nbytes % elem:
        raise ValueError(f"element width {elem} does not divide row_nbytes {row_nbytes}")

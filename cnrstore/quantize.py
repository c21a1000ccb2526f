"""Per-row quantization schemes: encode rows to self-contained byte rows and back.

Every encoded row stands alone (intN rows carry their own scale and offset), so a block or a
patch can store any subset of a table's rows. Encoding runs on the rows' device; the byte
layout of each scheme is specified in docs/QUANTIZATION.md ("Row encoding").

- "exact": the row's raw bytes (bit-identical, NaN payloads and -0.0 kept), any dtype.
- "fp16" / "bf16": a cast (values beyond the fp16 range saturate to +-65504).
- "int8" / "int4" / "int3" / "int2": asymmetric uniform codes q in [0, 2^bits - 1] with
  x ~ offset + q * scale, scale and offset stored as fp16 and the codes computed from the
  fp16 values (as FBGEMM does), codes bit-packed (cnrstore.bitpack). The range [lo, hi] is
  either the row's min/max or Check-N-Run's adaptive clipped range (cnrstore.qsearch).
"""

from __future__ import annotations

import math

import torch

from cnrstore.bitpack import pack_codes, packed_nbytes, unpack_codes
from cnrstore.qparams import FP16_MAX, dequantize, fp16_qparams, quantize_codes
from cnrstore.qsearch import SEARCHES, choose_ranges, choose_row_ranges

__all__ = [
    "SCHEMES",
    "LOSSY_DTYPES",
    "GREEDY_MAX_BITS",
    "check_scheme",
    "scheme_bits",
    "row_nbytes",
    "encode_rows",
    "decode_rows",
    "first_nonfinite_row",
    "max_abs_error",
    "auto_scheme",
]

SCHEMES = ("exact", "fp16", "bf16", "int8", "int4", "int3", "int2")
LOSSY_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
# fp16 scale then fp16 offset, little-endian, ahead of the packed codes.
HEADER_NBYTES = 4
# Default range search per row: Check-N-Run's adaptive clipping ("greedy",
# cnrstore.qsearch) up to GREEDY_MAX_BITS, plain "minmax" above. Measured on 4000x64 rows
# (docs/QUANTIZATION.md): greedy cuts the L2^2 error by 16-48% at 2-4 bits but only by
# 0.2-0.6% at 8 bits, for ~40x the encode time, so int8 defaults to min/max.
GREEDY_MAX_BITS = 4
# Elements per chunk when scanning for non-finite values (bounds the bool temporary).
_SCAN_ELEMS = 1 << 22
# Elements per encode chunk. CPU: below torch's intra-op grain size (32768), so no op
# forks OpenMP threads (10-100x slower on shared cores, measured) and the work buffers
# stay in cache. CUDA: a chunk only bounds temporary memory.
_CPU_CHUNK_ELEMS = (1 << 15) - 1
_CUDA_CHUNK_ELEMS = 1 << 24


def check_scheme(scheme: str, dtype: torch.dtype, *, table: str) -> None:
    """Raise ValueError (naming table, scheme and dtype) unless `scheme` can encode `dtype`."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(
            f"table {table!r}: unknown quantization scheme {scheme!r}; "
            f"expected one of {', '.join(SCHEMES)}"
        )
    if scheme != "exact" and dtype not in LOSSY_DTYPES:
        raise ValueError(
            f"table {table!r}: scheme {scheme!r} is lossy and needs a float32, float16, "
            f"bfloat16 or float64 table, but the table is {dtype}; use 'exact'"
        )


def scheme_bits(scheme: str) -> int | None:
    """Code width in bits of an intN scheme, None for the others."""
    return _BITS.get(scheme)


def row_nbytes(scheme: str, dtype: torch.dtype, width: int) -> int:
    """Bytes of one encoded row of `width` elements of `dtype` under `scheme`."""
    check_scheme(scheme, dtype, table="<row_nbytes>")
    if not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be an int >= 0, got {width!r}")
    if scheme == "exact":
        return width * _itemsize(dtype)
    if scheme in _CASTS:
        return 2 * width
    return HEADER_NBYTES + packed_nbytes(width, _BITS[scheme])


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_rows(rows: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.ndim != 2:
        raise ValueError(f"rows must be 2-D [n, width], got shape {list(rows.shape)}")


def encode_rows(rows: torch.Tensor, scheme: str, *, search: str | None = None) -> torch.Tensor:
    """[n, width] rows of the table's dtype -> uint8 [n, row_nbytes] on the same device.

    `search` picks the intN range per row: "greedy" or "minmax"; by default greedy for
    schemes of at most GREEDY_MAX_BITS bits, min/max for int8.
    Lossy schemes reject non-finite values (ValueError naming the first bad row).
    For "exact" the result may be a view of `rows` (no copy): copy it before `rows` changes.
    """
    _check_rows(rows)
    check_scheme(scheme, rows.dtype, table="<encode_rows>")
    if search is not None and search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    n, width = rows.shape
    if scheme == "exact":
        if width == 0:
            return torch.empty((n, 0), dtype=torch.uint8, device=rows.device)
        return rows.contiguous().view(torch.uint8).reshape(n, width * rows.element_size())
    if scheme in _CASTS:
        bad = first_nonfinite_row(rows)
        if bad is not None:
            raise _nonfinite_error(bad, scheme)
        return _encode_cast(rows, scheme)
    bits = _BITS[scheme]
    if search is None:
        search = "greedy" if bits <= GREEDY_MAX_BITS else "minmax"
    return _encode_int(rows, bits, search, scheme)


def _encode_cast(rows: torch.Tensor, scheme: str) -> torch.Tensor:
    n, width = rows.shape
    out = torch.empty((n, width), dtype=_CASTS[scheme], device=rows.device)
    budget = _CUDA_CHUNK_ELEMS if rows.device.type == "cuda" else _CPU_CHUNK_ELEMS
    step = max(1, budget // max(1, width))
    for start in range(0, n if width else 0, step):  # chunked as _encode_int
        part = out[start : start + step]
        part.copy_(rows[start : start + step])
        if scheme == "fp16":
            # Saturate instead of overflowing to inf: a finite table must decode finite.
            # (Clamping after the cast keeps the same result: the cast rounds to +-inf
            # only values beyond FP16_MAX.)
            part.clamp_(-FP16_MAX, FP16_MAX)
    return out.view(torch.uint8).reshape(n, 2 * width)


def _nonfinite_error(row: int, scheme: str) -> ValueError:
    return ValueError(f"row {row} holds NaN or Inf, which scheme {scheme!r} cannot encode")


def _encode_int(rows: torch.Tensor, bits: int, search: str, scheme: str) -> torch.Tensor:
    n, width = rows.shape
    device = rows.device
    out = torch.empty((n, row_nbytes(scheme, rows.dtype, width)), dtype=torch.uint8, device=device)
    if n == 0:
        return out
    # Row chunks keep every temporary cache-sized and reused: fresh full-size temporaries
    # cost more in page first-touch than the arithmetic itself.
    budget = _CUDA_CHUNK_ELEMS if device.type == "cuda" else _CPU_CHUNK_ELEMS
    chunk = max(1, budget // max(1, width))
    xbuf = torch.empty(min(chunk, n) * width, dtype=torch.float32, device=device)
    finite = torch.empty(n, dtype=torch.bool, device=device)
    ranges = choose_row_ranges(rows, bits, search=search)  # CPU greedy: all cores at once
    for start in range(0, n, chunk):
        part = rows[start : start + chunk]
        m = part.shape[0]
        x = xbuf[: m * width].view(m, width)
        x.copy_(part)
        if ranges is None:
            lo, hi = choose_ranges(x, bits, search=search, dtype=rows.dtype)
        else:
            lo, hi = ranges[0][start : start + m], ranges[1][start : start + m]
        # amin/amax propagate NaN and +-Inf, so the range says whether a row is finite.
        torch.logical_and(torch.isfinite(lo), torch.isfinite(hi), out=finite[start : start + m])
        scale, offset = fp16_qparams(lo, hi, bits)
        dest = out[start : start + m]
        dest[:, 0:2] = scale.to(torch.float16).view(torch.uint8).view(m, 2)
        dest[:, 2:4] = offset.to(torch.float16).view(torch.uint8).view(m, 2)
        dest[:, HEADER_NBYTES:] = pack_codes(quantize_codes(x, scale, offset, bits), bits)
    if width and not bool(finite.all()):  # one device sync per call, not per chunk
        raise _nonfinite_error(int(torch.nonzero(~finite)[0, 0]), scheme)
    return out


def decode_rows(codes: torch.Tensor, scheme: str, dtype: torch.dtype, width: int) -> torch.Tensor:
    """uint8 [n, row_nbytes(scheme, dtype, width)] -> [n, width] of `dtype` on codes.device."""
    nbytes = row_nbytes(scheme, dtype, width)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.ndim != 2:
        raise ValueError("codes must be a 2-D uint8 tensor")
    if codes.shape[1] != nbytes:
        raise ValueError(
            f"codes have {codes.shape[1]} bytes per row, scheme {scheme!r} with {width} "
            f"{dtype} elements needs {nbytes}"
        )
    n = codes.shape[0]
    if scheme == "exact":
        if width == 0:
            return torch.empty((n, 0), dtype=dtype, device=codes.device)
        return _dense(codes).view(dtype).reshape(n, width)
    out = torch.empty((n, width), dtype=dtype, device=codes.device)
    if n == 0 or width == 0:
        return out
    budget = _CUDA_CHUNK_ELEMS if codes.device.type == "cuda" else _CPU_CHUNK_ELEMS
    step = max(1, budget // width)
    for start in range(0, n, step):  # chunked for the same reason as encoding
        _decode_into(codes[start : start + step], scheme, width, out[start : start + step])
    return out


def _decode_into(codes: torch.Tensor, scheme: str, width: int, out: torch.Tensor) -> None:
    n = codes.shape[0]
    if scheme in _CASTS:
        out.copy_(_dense(codes).view(_CASTS[scheme]).view(n, width))
        return
    params = _dense(codes[:, :HEADER_NBYTES]).view(torch.float16).to(torch.float32)
    scale, offset = params[:, 0:1], params[:, 1:2]
    q = unpack_codes(codes[:, HEADER_NBYTES:], _BITS[scheme], width)
    out.copy_(dequantize(q, scale, offset))


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t itself if its bytes can be reinterpreted as a wider dtype, else a dense copy."""
    if t.is_contiguous() and t.stride(0) == t.shape[1] and t.storage_offset() % 8 == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def first_nonfinite_row(rows: torch.Tensor) -> int | None:
    """Index of the first row (dim 0) holding NaN or +-Inf, or None; None for int/bool."""
    if not isinstance(rows, torch.Tensor) or rows.ndim < 1:
        raise ValueError("first_nonfinite_row needs a tensor with ndim >= 1")
    if not rows.is_floating_point() or rows.numel() == 0:
        return None
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    step = max(1, _SCAN_ELEMS // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], step):
        part = flat[start : start + step]
        # A row sum is finite when every element is (NaN and Inf propagate); it can also
        # overflow on finite rows, so only rows with a non-finite sum get the exact check.
        suspects = torch.nonzero(~torch.isfinite(part.sum(dim=1, dtype=acc)))[:, 0]
        if suspects.numel():
            bad = ~torch.isfinite(part[suspects]).all(dim=1)
            hits = suspects[bad]
            if hits.numel():
                return start + int(hits[0])
    return None


# Relative rounding slack of the float32 encode/decode arithmetic (a few ulps, see
# docs/QUANTIZATION.md "Error bound") and the output rounding of each table dtype.
_F32_SLACK = 2.0**-21
_OUT_REL = {
    torch.float32: 0.0,
    torch.float64: 0.0,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
_OUT_ABS = {
    torch.float32: 0.0,
    torch.float64: 0.0,
    torch.float16: 2.0**-25,
    torch.bfloat16: 2.0**-134,
}


def max_abs_error(scheme: str, rows: torch.Tensor) -> torch.Tensor:
    """Per-row float64 bound [n] on |decode(encode(rows, search="minmax")) - rows|.

    Holds for finite rows whose values lie within +-FP16_MAX (beyond it, fp16 saturates).
    intN: scale / 2 + slack * (|offset| + levels * scale) + output rounding of the dtype;
    fp16/bf16: the half-ulp of the cast; exact: 0.
    """
    _check_rows(rows)
    check_scheme(scheme, rows.dtype, table="<max_abs_error>")
    n = rows.shape[0]
    x = rows.to(torch.float64)
    if scheme == "exact" or rows.shape[1] == 0:
        return torch.zeros(n, dtype=torch.float64, device=rows.device)
    amax = x.abs().amax(dim=1)
    if scheme in _CASTS:
        rel = 2.0**-11 if scheme == "fp16" else 2.0**-8
        tiny = 2.0**-25 if scheme == "fp16" else 2.0**-134
        return amax * rel + tiny + amax * _OUT_REL[rows.dtype] + _OUT_ABS[rows.dtype]
    bits = _BITS[scheme]
    levels = (1 << bits) - 1
    lo, hi = rows.to(torch.float32).amin(dim=1), rows.to(torch.float32).amax(dim=1)
    scale, offset = fp16_qparams(lo, hi, bits)
    scale, offset = scale[:, 0].double(), offset[:, 0].double()
    span = offset.abs() + levels * scale
    return scale / 2 + span * (_F32_SLACK + _OUT_REL[rows.dtype]) + _OUT_ABS[rows.dtype]


# "auto" policy (docs/QUANTIZATION.md, "The auto policy"): quantization error compounds
# with every restore (each restore resumes training from the dequantized tables), so the
# fewer restores a job expects, the fewer bits its checkpoints can afford. Calibrated by
# benches/quality.py (docs/QUALITY.md): against Check-N-Run's 0.01% budget int4 was
# indistinguishable from exact up to 5 restores and failed at 20; int8 held at 5; int2 and
# int3 failed from 1 and 5 restores, so the policy never picks them.
AUTO_INT4_MAX_RESTORES = 5.0
AUTO_INT8_MAX_RESTORES = 10.0
# Beyond AUTO_INT8_MAX_RESTORES: fp16 (at noise level after 20 restores in the same runs).


def auto_scheme(expected_restores: float) -> str:
    """The scheme the "auto" policy picks for a job expecting this many restores."""
    if isinstance(expected_restores, bool) or not isinstance(expected_restores, (int, float)):
        raise TypeError(f"expected_restores must be a number, got {expected_restores!r}")
    if not expected_restores >= 0 or expected_restores == float("inf"):
        raise ValueError(f"expected_restores must be finite and >= 0, got {expected_restores}")
    if expected_restores <= AUTO_INT4_MAX_RESTORES:
        return "int4"
    if expected_restores <= AUTO_INT8_MAX_RESTORES:
        return "int8"
    return "fp16"

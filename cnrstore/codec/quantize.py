"""Per-row quantization schemes: encode rows to self-contained byte rows and back.

Every encoded row stands alone (intN rows carry their own scale and offset), so a block or a
patch can store any subset of a table's rows. Encoding runs on the rows' device; the byte
layout of each scheme is specified in docs/QUANTIZATION.md ("Row encoding").

- "exact": the row's raw bytes (bit-identical, NaN payloads and -0.0 kept), any dtype.
- "fp16" / "bf16": a cast. Finite values the cast would turn into inf (beyond +-65504
  for fp16) are refused (RangeError), never clamped.
- "int8" / "int4" / "int3" / "int2": asymmetric uniform codes q in [0, 2^bits - 1] with
  x ~ offset + q * scale, scale and offset stored as fp16 and the codes computed from the
  fp16 values (as FBGEMM does), codes bit-packed (cnrstore.codec.bitpack). The range [lo, hi] is
  either the row's min/max or Check-N-Run's adaptive clipped range (cnrstore.codec.qsearch).
  Rows whose range fp16 cannot cover need "wide" rows, with fp32 scale and offset (8
  header bytes instead of 4; a table's rows are all narrow or all wide, told apart by
  their size): encoding narrow raises NeedsWideQparams for them.
"""

from __future__ import annotations

import math

import torch

from cnrstore.codec import native
from cnrstore.codec.bitpack import pack_codes, unpack_codes
from cnrstore.codec.layout import (
    BITS as _BITS,
)
from cnrstore.codec.layout import (
    HEADER_NBYTES,
    LOSSY_DTYPE_NAMES,
    SCHEMES,
    WIDE_HEADER_NBYTES,
    check_scheme_name,
    dtype_name,
    row_nbytes_of,
)
from cnrstore.codec.qparams import (
    FP16_MAX,
    FP32_MAX,
    dequantize,
    fits_fp16,
    fp16_qparams,
    fp32_qparams,
    quantize_codes,
    within_limit,
)
from cnrstore.codec.qsearch import SEARCHES, choose_ranges, choose_row_ranges

__all__ = [
    "SCHEMES", "LOSSY_DTYPES", "GREEDY_MAX_BITS", "check_scheme", "scheme_bits", "row_nbytes",
    "row_nbytes_options", "is_wide", "encode_rows", "decode_rows", "first_nonfinite_row",
    "RangeError", "NeedsWideQparams",
]

# SCHEMES, the header sizes and row sizes come from cnrstore.codec.layout (torch-free).
LOSSY_DTYPES = tuple(getattr(torch, name) for name in LOSSY_DTYPE_NAMES)
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Default range search per row: adaptive clipping ("grid", cnrstore.codec.qgrid: lower
# total error than Check-N-Run's "greedy" walk at a third of its cost) up to
# GREEDY_MAX_BITS, plain "minmax" above. Measured on 4000x64 rows
# (docs/QUANTIZATION.md): greedy cuts the L2^2 error by 16-48% at 2-4 bits but only by
# 0.2-0.6% at 8 bits, for ~40x the encode time, so int8 defaults to min/max.
GREEDY_MAX_BITS = 4
# The search those schemes take by default (benches/bench_quant.py times both in one run).
LOW_BITS_SEARCH = "grid"
# Elements per chunk when scanning for non-finite values (bounds the bool temporary).
_SCAN_ELEMS = 1 << 22
# Elements per encode chunk. CPU: below torch's intra-op grain size (32768), so no op
# forks OpenMP threads (10-100x slower on shared cores, measured) and the work buffers
# stay in cache. CUDA: a chunk only bounds temporary memory.
_CPU_CHUNK_ELEMS = (1 << 15) - 1
# With one intra-op thread no op forks anything, and per-op overhead (~5-10 us, ~15 ops a
# chunk) is what a small chunk costs: 16x larger chunks (2 MiB of float32, cache-sized)
# encode int8 3x faster (1.05 M x 64 rows: 0.67-1.09 s -> 0.23 s, benches/results/).
_SERIAL_CHUNK_FACTOR = 16


def _cpu_chunk_elems() -> int:
    return _CPU_CHUNK_ELEMS * (_SERIAL_CHUNK_FACTOR if torch.get_num_threads() == 1 else 1)


# Decoding takes a block in one chunk (a default block of 32768 x 64 is 2 M elements; up to
# 16 MiB fp32): at the encode chunk per-op overhead was half of an int8 restore
# (benches/results/bench_checkpoint.md, "Issue 14, third pass"). int8 into fp32 has no chunk
# temporary.
_CPU_DECODE_CHUNK_ELEMS = 1 << 22
_CUDA_CHUNK_ELEMS = 1 << 24


class RangeError(ValueError):
    """Finite values of row ``row`` that the scheme cannot represent (they would saturate
    or turn into inf)."""

    def __init__(self, row: int, scheme: str):
        super().__init__(f"row {row} holds finite values beyond what {scheme!r} can represent")
        self.row = row


class NeedsWideQparams(ValueError):
    """Row ``row``'s range does not fit fp16 scale/offset: encode the rows wide."""

    def __init__(self, row: int):
        super().__init__(f"row {row} needs fp32 scale/offset (wide rows)")
        self.row = row


def check_scheme(scheme: str, dtype: torch.dtype, *, table: str) -> None:
    """Raise ValueError (naming table, scheme and dtype) unless `scheme` can encode `dtype`."""
    check_scheme_name(scheme, dtype_name(dtype), table=table)


def scheme_bits(scheme: str) -> int | None:
    """Code width in bits of an intN scheme, None for the others."""
    return _BITS.get(scheme)


def row_nbytes(scheme: str, dtype: torch.dtype, width: int, *, wide: bool = False) -> int:
    """Bytes of one encoded row of `width` elements of `dtype` under `scheme` (``wide``:
    intN rows with fp32 scale/offset)."""
    return row_nbytes_of(scheme, dtype_name(dtype), width, itemsize=_itemsize(dtype), wide=wide)


def row_nbytes_options(scheme: str, dtype: torch.dtype, width: int) -> tuple[int, ...]:
    """The row sizes a stored table of this scheme, dtype and width may have."""
    if scheme in _BITS:
        return (row_nbytes(scheme, dtype, width), row_nbytes(scheme, dtype, width, wide=True))
    return (row_nbytes(scheme, dtype, width),)


def is_wide(scheme: str, dtype: torch.dtype, width: int, nbytes: int) -> bool:
    """True when rows of ``nbytes`` bytes are wide intN rows."""
    return scheme in _BITS and nbytes == row_nbytes(scheme, dtype, width, wide=True)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _check_rows(rows: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.ndim != 2:
        raise ValueError(f"rows must be 2-D [n, width], got shape {list(rows.shape)}")


def encode_rows(
    rows: torch.Tensor, scheme: str, *, search: str | None = None, wide: bool = False
) -> torch.Tensor:
    """[n, width] rows of the table's dtype -> uint8 [n, row_nbytes] on the same device.

    `search` picks the intN range per row: "grid", "greedy" or "minmax"; by default grid
    for schemes of at most GREEDY_MAX_BITS bits, min/max for int8. `wide`: intN rows with fp32
    scale/offset; without it a row that needs them raises NeedsWideQparams.
    Lossy schemes reject non-finite values (ValueError naming the first bad row) and
    finite values they cannot represent (RangeError).
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
        search = LOW_BITS_SEARCH if bits <= GREEDY_MAX_BITS else "minmax"
    return _encode_int(rows, bits, search, scheme, wide)


def _encode_cast(rows: torch.Tensor, scheme: str) -> torch.Tensor:
    n, width = rows.shape
    out = torch.empty((n, width), dtype=_CASTS[scheme], device=rows.device)
    budget = _CUDA_CHUNK_ELEMS if rows.device.type == "cuda" else _cpu_chunk_elems()
    step = max(1, budget // max(1, width))
    over = torch.zeros(n, dtype=torch.bool, device=rows.device)
    for start in range(0, n if width else 0, step):  # chunked as _encode_int
        part = out[start : start + step]
        part.copy_(rows[start : start + step])
        # The rows are finite (checked first), so inf here is a value the cast rounded
        # beyond its range: refused, never clamped (issue 8).
        over[start : start + step] = torch.isinf(part).any(dim=1)
    if width and bool(over.any()):  # one device sync per call
        raise RangeError(int(torch.nonzero(over)[0, 0]), scheme)
    return out.view(torch.uint8).reshape(n, 2 * width)


def _nonfinite_error(row: int, scheme: str) -> ValueError:
    return ValueError(f"row {row} holds NaN or Inf, which scheme {scheme!r} cannot encode")


def _encode_int(
    rows: torch.Tensor, bits: int, search: str, scheme: str, wide: bool
) -> torch.Tensor:
    n, width = rows.shape
    device = rows.device
    head = WIDE_HEADER_NBYTES if wide else HEADER_NBYTES
    out = torch.empty(
        (n, row_nbytes(scheme, rows.dtype, width, wide=wide)), dtype=torch.uint8, device=device
    )
    if n == 0:
        return out
    if bits == 8 and search == "minmax" and not wide and _encode_int8_native(rows, out, scheme):
        return out
    # Row chunks keep every temporary cache-sized and reused: fresh full-size temporaries
    # cost more in page first-touch than the arithmetic itself.
    budget = _CUDA_CHUNK_ELEMS if device.type == "cuda" else _cpu_chunk_elems()
    chunk = max(1, budget // max(1, width))
    xbuf = torch.empty(min(chunk, n) * width, dtype=torch.float32, device=device)
    finite = torch.empty(n, dtype=torch.bool, device=device)
    fits = torch.ones(n, dtype=torch.bool, device=device)
    # CPU greedy: all cores at once. Wide rows take the torch walk, whose losses use the
    # fp32 qparams they will be stored with.
    ranges = None if wide else choose_row_ranges(rows, bits, search=search)
    for start in range(0, n, chunk):
        part = rows[start : start + chunk]
        m = part.shape[0]
        x = xbuf[: m * width].view(m, width)
        x.copy_(part)
        if ranges is None:
            lo, hi = choose_ranges(x, bits, search=search, dtype=rows.dtype, wide=wide)
        else:
            lo, hi = ranges[0][start : start + m], ranges[1][start : start + m]
        dest = out[start : start + m]
        if wide:
            scale, offset = fp32_qparams(lo, hi, bits)
            dest[:, 0:4] = scale.view(torch.uint8).view(m, 4)
            dest[:, 4:8] = offset.view(torch.uint8).view(m, 4)
        else:
            fits[start : start + m] = fits_fp16(lo, hi)
            scale, offset = fp16_qparams(lo, hi, bits)
            dest[:, 0:2] = scale.to(torch.float16).view(torch.uint8).view(m, 2)
            dest[:, 2:4] = offset.to(torch.float16).view(torch.uint8).view(m, 2)
        # amin/amax propagate NaN and +-Inf, so the range says whether a row is finite;
        # a wide row's scale is inf where its codes would decode beyond float32.
        torch.logical_and(torch.isfinite(lo), torch.isfinite(hi), out=finite[start : start + m])
        finite[start : start + m] &= torch.isfinite(scale[:, 0])
        dest[:, head:] = pack_codes(quantize_codes(x, scale, offset, bits), bits)
    if width and not bool(finite.all()):  # one device sync per call, not per chunk
        bad = int(torch.nonzero(~finite)[0, 0])
        if bool(torch.isfinite(rows[bad]).all()):  # finite, yet beyond float32 (float64)
            raise RangeError(bad, scheme)
        raise _nonfinite_error(bad, scheme)
    if width and not bool(fits.all()):
        raise NeedsWideQparams(int(torch.nonzero(~fits)[0, 0]))
    return out


def _encode_int8_native(rows: torch.Tensor, out: torch.Tensor, scheme: str) -> bool:
    """int8 min/max rows by the compiled one-pass kernel (native.py; the same float32 steps
    as the loop below, which tests check it against), refusing rows as that loop does.
    False where it does not apply (no kernel, not float32 rows on the CPU with unit
    stride): the caller encodes."""
    kernels = native.kernel()
    if (kernels is None or kernels.encode_int8 is None or rows.device.type != "cpu"
            or rows.dtype != torch.float32 or rows.shape[1] == 0 or rows.stride(1) != 1
            or not out.is_contiguous()):
        return False
    n, width = rows.shape
    flags = torch.empty(n, dtype=torch.uint8)
    kernels.encode_int8(rows.data_ptr(), n, width, rows.stride(0), out.data_ptr(),
                        flags.data_ptr())
    if bool(flags.any()):  # one check for the common case: no row refused
        bad = torch.nonzero(flags & 1)
        if bad.numel():
            raise _nonfinite_error(int(bad[0, 0]), scheme)
        raise NeedsWideQparams(int(torch.nonzero(flags & 2)[0, 0]))
    return True


def decode_rows(codes: torch.Tensor, scheme: str, dtype: torch.dtype, width: int,
                *, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [n, row_nbytes(scheme, dtype, width)] -> [n, width] of `dtype` on codes.device
    (intN rows narrow or wide, told apart by their size). With ``out`` ([n, width] of
    `dtype`, on codes.device) the rows are decoded into it, chunk by chunk: a restore
    writes straight into the table it returns, with no block-sized temporary."""
    options = row_nbytes_options(scheme, dtype, width)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.ndim != 2:
        raise ValueError("codes must be a 2-D uint8 tensor")
    if codes.shape[1] not in options:
        raise ValueError(
            f"codes have {codes.shape[1]} bytes per row, scheme {scheme!r} with {width} "
            f"{dtype} elements needs {' or '.join(map(str, options))}"
        )
    wide = is_wide(scheme, dtype, width, codes.shape[1])
    n = codes.shape[0]
    if out is not None and (tuple(out.shape) != (n, width) or out.dtype != dtype
                            or out.device != codes.device):
        raise ValueError(f"out must be [{n}, {width}] {dtype} on {codes.device}")
    if scheme == "exact":
        if width == 0:
            rows = torch.empty((n, 0), dtype=dtype, device=codes.device)
        else:
            rows = _dense(codes).view(dtype).reshape(n, width)
        if out is None:
            return rows
        out.copy_(rows)
        return out
    if out is None:
        out = torch.empty((n, width), dtype=dtype, device=codes.device)
    if n == 0 or width == 0:
        return out
    budget = _CUDA_CHUNK_ELEMS if codes.device.type == "cuda" else _CPU_DECODE_CHUNK_ELEMS
    step = max(1, budget // width)
    for start in range(0, n, step):  # chunked: temporaries stay bounded
        _decode_into(codes[start : start + step], scheme, width, out[start : start + step], wide)
    return out


def _decode_into(
    codes: torch.Tensor, scheme: str, width: int, out: torch.Tensor, wide: bool
) -> None:
    n = codes.shape[0]
    if scheme in _CASTS:
        out.copy_(_dense(codes).view(_CASTS[scheme]).view(n, width))
        return
    # The qparams are copied dense first (converting the strided fp16 columns directly
    # ran 9x slower), bounded with one reduction, and 8-bit codes are read in place.
    if wide:
        params = _dense(codes[:, :WIDE_HEADER_NBYTES]).view(torch.float32)
        head, limit = WIDE_HEADER_NBYTES, FP32_MAX
    else:
        params = _dense(codes[:, :HEADER_NBYTES]).view(torch.float16).to(torch.float32)
        head, limit = HEADER_NBYTES, FP16_MAX
    scale, offset = params[:, 0:1], params[:, 1:2]
    q = unpack_codes(codes[:, head:], _BITS[scheme], width)
    if out.dtype == torch.float32 and out.is_contiguous():
        # dequantize's arithmetic (float32 q * scale + offset, clamped) written straight
        # into the table: no float32 temporary and no copy of it (a restore's hot loop).
        # The codes are converted first (exact: q < 2^8) and scaled in place: the mixed
        # uint8 x float32 multiply ran 1.5x slower than the same-dtype ops.
        out.copy_(q)
        out.mul_(scale).add_(offset)
        if not within_limit(scale, offset, (1 << _BITS[scheme]) - 1, limit, both=params):
            out.clamp_(-limit, limit)
        return
    out.copy_(dequantize(q, scale, offset, limit=limit))


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

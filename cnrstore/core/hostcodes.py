"""The host codes of the rows a put writes: gather them on the table's device, encode them,
copy them to host memory the caller's table does not share (docs/ARCHITECTURE.md, "A put
and a get", step 2), now or, for a non-blocking put, on the writer thread.

A non-blocking put's stall is what runs on the caller's thread (issue 27: <= 0.05x
torch.save). Of an incremental intN put, the encode of the changed rows was the largest
part after the fingerprint pass; ``snapshot_rows`` takes only a copy of those rows (the
state the step must hold) plus their min/max, which tell every refusal the encode could
raise (NaN/Inf, a row that needs wide qparams) before the put returns, and hands the encode
to the writer. The writer then calls the same ``encode_rows`` on the same rows, so the
stored bytes are those a blocking put stores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from cnrstore.codec import fingerprint as fpm
from cnrstore.codec import native
from cnrstore.codec.qparams import fits_fp16
from cnrstore.codec.quantize import RangeError, encode_rows, first_nonfinite_row, scheme_bits
from cnrstore.errors import NonFiniteValues, ValueOutOfRange

__all__ = ["DEFER_DTYPES", "HostBuffers", "copy_checked", "copy_refusing", "encode_checked",
           "gather_encode", "snapshot_rows"]

# Table dtypes whose rows are deferred: every finite value converts to a finite float32, so
# the min/max below decide all the encode's refusals (float64 rows beyond float32 are
# refused by the encode itself, which therefore stays on the caller's thread).
DEFER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Below torch's intra-op grain size, so no reduction forks OpenMP threads (on shared cores
# each fork waits for a time slice; see codec/quantize.py).
_RANGE_CHUNK_ELEMS = (1 << 15) - 1
# A copy of at least this many bytes of changed rows runs in row parts on every core, as the
# fingerprint pass does (its pool): the scattered rows' cache misses overlap across cores.
_SPLIT_COPY_BYTES = 4 << 20


class HostBuffers:
    """A small pool of host buffers reused across puts: these VMs first-touch fresh memory
    at well under 1 GB/s, so a fresh staging buffer per put would cost more than the copy.
    Buffers for CUDA tables are pinned, so the device-to-host copy runs at full speed.
    At most ``keep`` buffers (or as many as were ever out at once, if more: a put takes one
    per table) of together at most ``max_bytes`` are kept; larger ones (a
    first put of a huge table) are freed rather than pinned in memory for good."""

    def __init__(self, *, keep: int = 4, max_bytes: int = 2 << 30):
        self._free: list[torch.Tensor] = []
        self._keep = keep
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        # Buffers out at once, at most: a put of more tables than ``keep`` takes one per
        # table, and a count cap below that freed one at every put, so the next put
        # first-touched a fresh one in its stall (issue 27). The byte budget still holds.
        self._out = 0
        self._peak_out = 0

    def take(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
        with self._lock:
            fits = [
                (b.numel(), i) for i, b in enumerate(self._free)
                if b.numel() >= nbytes and b.is_pinned() == pinned
            ]
            self._out += 1
            self._peak_out = max(self._peak_out, self._out)
            if fits:
                return self._free.pop(min(fits)[1])
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._out = max(0, self._out - 1)
            self._free.append(buf)
            keep = max(self._keep, self._peak_out)
            while self._free and (
                len(self._free) > keep
                or sum(b.numel() for b in self._free) > self._max_bytes
            ):
                # Drop the largest when over the byte budget, else the smallest.
                sizes = [b.numel() for b in self._free]
                over = sum(sizes) > self._max_bytes
                pick = max if over else min
                self._free.pop(pick(range(len(sizes)), key=sizes.__getitem__))

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


def encode_checked(name: str, rows: torch.Tensor, scheme: str, wide: bool, idx
                   ) -> torch.Tensor:
    """encode_rows, with a row the scheme cannot represent refused as ValueOutOfRange
    (``idx`` maps the rows' positions to table rows; None: the same)."""
    try:
        return encode_rows(rows, scheme, wide=wide)
    except RangeError as exc:
        raise ValueOutOfRange(name, exc.row if idx is None else int(idx[exc.row]), scheme
                              ) from None


def snapshot_rows(name: str, x: torch.Tensor, idx: np.ndarray, scheme: str,
                  buffers: HostBuffers | None, wide: bool
                  ) -> tuple[Callable[[], np.ndarray], Callable[[], None] | None] | None:
    """Copy rows ``idx`` of the CPU table ``x`` for an encode on the writer thread:
    (encode, release), where ``encode()`` returns the codes ``gather_encode`` would
    have, and ``release`` returns the copy's buffer. None where the encode must run now
    (exact and cast schemes, CUDA tables, other dtypes, no rows, or a row whose min/max
    does not fit fp16 qparams: the encode decides whether the table goes wide). Raises
    NonFiniteValues as gather_encode does, before anything is queued."""
    n, width = len(idx), x.shape[1]
    if (scheme_bits(scheme) is None or x.is_cuda or x.dtype not in DEFER_DTYPES
            or buffers is None or not n or not width):
        return None
    nbytes = n * width * x.element_size()
    buf = buffers.take(nbytes, pinned=False)
    try:
        rows = buf[:nbytes].view(x.dtype).view(n, width)
        if not copy_refusing(name, x, idx, rows, scheme, wide):
            buffers.give(buf)
            return None
    except BaseException:
        buffers.give(buf)
        raise

    def encode() -> np.ndarray:
        return encode_checked(name, rows, scheme, wide, idx).numpy()

    return encode, lambda: buffers.give(buf)


def copy_refusing(name: str, x: torch.Tensor, idx: np.ndarray, rows: torch.Tensor,
                   scheme: str, wide: bool) -> bool:
    """``copy_checked`` of rows ``idx`` of table ``name`` into ``rows``, raising
    NonFiniteValues for a NaN or infinite row as the encode would; False where a row's
    min/max needs wide qparams and the table is not wide (the encode in the stall then
    decides whether the table goes wide)."""
    finite, fits = copy_checked(x, idx, rows)
    if not finite.all():
        raise NonFiniteValues(name, int(idx[int(np.argmin(finite))]), scheme)
    return wide or bool(fits.all())


def copy_checked(x: torch.Tensor, idx: np.ndarray, rows: torch.Tensor
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Copy rows ``idx`` of ``x`` into ``rows``; bool [n] arrays: each row is finite, its
    min/max fit fp16 qparams. One pass per row in the compiled kernel (float32 rows with
    unit stride), else index_select and chunked amin/amax (which give the same answers)."""
    n, width = rows.shape
    kernels = native.kernel()
    if (kernels is not None and kernels.gather_check_f32 is not None
            and x.dtype == torch.float32 and x.stride(1) == 1):
        ids = np.ascontiguousarray(idx, dtype=np.int64)
        flags = np.empty(n, dtype=np.uint8)
        fn, src, stride = kernels.gather_check_f32, x.data_ptr(), x.stride(0)
        dst, ip, fp = rows.data_ptr(), ids.ctypes.data, flags.ctypes.data

        def part(lo: int, hi: int) -> None:  # rows [lo, hi) of the copy
            fn(src, stride, ip + 8 * lo, hi - lo, width, dst + 4 * width * lo, fp + lo)

        fpm.in_parts(n, min(fpm._cores(), n) if n * width * 4 >= _SPLIT_COPY_BYTES else 1,
                     part)
        return (flags & 1) == 0, (flags & 2) == 0
    torch.index_select(x, 0, torch.from_numpy(idx), out=rows)
    low = torch.empty(n, dtype=x.dtype)
    high = torch.empty(n, dtype=x.dtype)
    step = max(1, _RANGE_CHUNK_ELEMS // width)
    for lo in range(0, n, step):
        # amin/amax propagate NaN and +-Inf; aminmax(dim=1) ran 10x slower than both
        torch.amin(rows[lo:lo + step], dim=1, out=low[lo:lo + step])
        torch.amax(rows[lo:lo + step], dim=1, out=high[lo:lo + step])
    finite = torch.isfinite(low) & torch.isfinite(high)
    fits = fits_fp16(low.float(), high.float())
    return finite.numpy(), fits.numpy()


def gather_encode(
    name: str,
    x: torch.Tensor,
    idx: np.ndarray | None,
    scheme: str,
    rnb: int,
    buffers: HostBuffers | None,
    wide: bool = False,
) -> tuple[np.ndarray, Callable[[], None] | None]:
    """Gather rows ``idx`` (None: all) of ``x`` on its device, encode them, and copy the codes
    to host memory that nothing else references (the caller may mutate ``x`` right after)."""
    whole = idx is None
    n = len(x) if idx is None else len(idx)
    idx_t = None if idx is None else torch.from_numpy(idx).to(x.device)
    nbytes = n * rnb
    if nbytes == 0:  # no rows to write, or zero-width rows: nothing to encode
        return np.zeros((n, rnb), dtype=np.uint8), None
    if scheme == "exact" and not x.is_cuda and buffers is not None and nbytes:
        # Exact codes are the raw row bytes: gather straight into a reused host buffer.
        buf = buffers.take(nbytes, pinned=False)
        dst = buf[:nbytes].view(x.dtype).view(n, x.shape[1])
        if idx_t is None:
            dst.copy_(x)
        else:
            torch.index_select(x, 0, idx_t, out=dst)
        return buf[:nbytes].numpy().reshape(n, rnb), lambda: buffers.give(buf)
    sel = x if idx_t is None else x.index_select(0, idx_t)
    if scheme != "exact" and n:
        bad = first_nonfinite_row(sel)
        if bad is not None:
            raise NonFiniteValues(name, bad if idx is None else int(idx[bad]), scheme)
    codes = encode_checked(name, sel, scheme, wide, None if whole else idx)
    if not codes.is_cuda or buffers is None or nbytes == 0:
        # Codes may alias the table (exact bytes, or a cast to the table's own dtype): copy
        # those, so the caller may modify the table as soon as the put returns.
        alias = codes.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        host = codes.to("cpu", copy=True) if (alias or codes.is_cuda) else codes
        return host.numpy().reshape(n, rnb), None
    buf = buffers.take(nbytes, pinned=True)
    host = buf[:nbytes].view(n, rnb)
    host.copy_(codes, non_blocking=True)
    torch.cuda.current_stream(codes.device).synchronize()
    return host.numpy(), lambda: buffers.give(buf)

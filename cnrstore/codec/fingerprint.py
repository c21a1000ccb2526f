"""Per-row 64-bit fingerprints of a table, computed on the table's own device.

A put compares each row's fingerprint with the one kept from the previous put to find the
changed rows without moving the table off its device. The hash therefore has to be
bit-identical on CPU and CUDA, which rules out float reductions and anything whose result
depends on the reduction order: it uses torch integer ops only, and the one reduction is a
wrapping int64 sum, which is associative and commutative.

Construction (see docs/QUANTIZATION.md, "Row fingerprints", for the collision analysis):

1. The row's bytes are viewed as little-endian 64-bit words w_j (zero-padded to a multiple
   of 8 bytes; the byte length is mixed in at the end, so padding cannot alias).
2. Each word goes through a position-keyed bijection of the 64-bit ring
       f_j(w) = M(w XOR a_j) * b_j,   M(x) = y XOR (y >>> 32) with y = x * C
   with random 64-bit a_j and random odd b_j. The xorshift is the nonlinear step: a purely
   linear sum of words times odd keys maps a flip of bit 63 in two words to
   2^63 * (odd + odd) = 0 mod 2^64, i.e. it misses two sign flips of float64 rows.
3. h = sum_j f_j(w_j) mod 2^64, then h XOR (nbytes * golden) and the splitmix64 finalizer.

Rows are processed in chunks through reused buffers: these VMs first-touch fresh memory at
well under 1 GB/s, so allocating temporaries the size of the table would dominate.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from cnrstore.codec import native
from cnrstore.codec.cores import cores, thread_pool

__all__ = ["row_fingerprints", "FINGERPRINT_VERSION", "in_parts"]

T = TypeVar("T")

# Bump when the construction or the keys change: stored fingerprints become incomparable.
FINGERPRINT_VERSION = 1

_MASK64 = (1 << 64) - 1
_SEED = 0x6A09E667F3BCC908  # sqrt(2) fraction bits: a nothing-up-my-sleeve seed
_C = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd
_LEN_MUL = 0xD6E8FEB86659FD93
# Words per chunk. CPU: 128 KiB buffers stay in L2, and every op stays below torch's
# intra-op grain size (32768 elements) so none forks OpenMP threads: on shared cores each
# fork/join waits for a time slice (measured 15.7 s instead of 1.8 s for 1 GiB).
# CUDA: a chunk (32 MiB per buffer) only bounds temporary memory.
_CPU_CHUNK_WORDS = 1 << 14
_SERIAL_ELEMS = 32767  # torch runs an op on fewer elements than its grain size serially
_CUDA_CHUNK_WORDS = 1 << 22
# A CPU table at least this large is hashed in parts on every core: each part's chunk loop
# runs in numpy or torch ops that release the GIL, so two cores hash 1 GB fp32 at 4.8 GB/s
# against 2.9 GB/s on one (benches/bench_fingerprint.py); a non-blocking put waits for
# this pass (issue 14's stall). Below it, handing parts to threads costs more than it saves.
_SPLIT_MIN_BYTES = 16 << 20


def _to_signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _splitmix64_stream(seed: int, count: int) -> list[int]:
    out = []
    state = seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


_keys_lock = threading.Lock()
_split_lock = threading.Lock()
_split_pool: ThreadPoolExecutor | None = None
_key_cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
_buffers_lock = threading.Lock()
_buffer_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _reset_after_fork() -> None:
    # A thread of the parent may have held a lock at fork(); it does not exist in the
    # child, so the lock would never be released. The caches may be mid-update: drop them.
    global _keys_lock, _buffers_lock, _split_lock, _split_pool
    _keys_lock = threading.Lock()
    _buffers_lock = threading.Lock()
    _split_lock = threading.Lock()
    _split_pool = None  # its threads do not exist in the child
    _key_cache.clear()
    _buffer_cache.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def _keys(device: torch.device, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-position keys (a_j, b_j) for rows of `words` words, cached per device.

    Key j depends only on j (not on the row length), so the keys of a longer row extend
    those of a shorter one; the cache keeps the longest prefix generated so far.
    """
    key = (str(device), 0)
    with _keys_lock:
        cached = _key_cache.get(key)
        if cached is None or cached[0].numel() < words:
            count = max(words, 2 * (cached[0].numel() if cached is not None else 0), 64)
            raw = _splitmix64_stream(_SEED, 2 * count)
            a = torch.tensor([_to_signed(v) for v in raw[0::2]], dtype=torch.int64)
            b = torch.tensor([_to_signed(v | 1) for v in raw[1::2]], dtype=torch.int64)
            cached = (a.to(device), b.to(device))
            _key_cache[key] = cached
    return cached[0][:words], cached[1][:words]


def _cache_key(device: torch.device) -> tuple:
    # On CUDA, work queued on one stream may still be reading a buffer after the Python
    # loop returned it; only the same stream is ordered after that work.
    if device.type == "cuda":
        return (str(device), torch.cuda.current_stream(device).cuda_stream)
    return (str(device), 0)


def _take_buffers(device: torch.device, elems: int):
    """Three flat int64 buffers of at least `elems` words, reused across calls.

    One set is kept per device (and CUDA stream), grown to the largest chunk seen, so the
    cache holds at most 3 chunks' worth of memory per device however many table shapes
    come by; concurrent callers on the same device allocate their own.
    """
    with _buffers_lock:
        bufs = _buffer_cache.pop(_cache_key(device), None)
    if bufs is None or bufs[0].numel() < elems:
        bufs = tuple(torch.empty(elems, dtype=torch.int64, device=device) for _ in range(3))
    return bufs


def _return_buffers(device: torch.device, bufs) -> None:
    with _buffers_lock:
        key = _cache_key(device)
        held = _buffer_cache.get(key)
        if held is None or held[0].numel() < bufs[0].numel():
            _buffer_cache[key] = bufs


def _row_nbytes(table: torch.Tensor) -> int:
    return math.prod(table.shape[1:]) * table.element_size()


def _avalanche(h: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 (logical shifts via masks), in place."""
    low = (1 << 34) - 1
    h ^= (h >> 30) & low
    h *= _to_signed(0xBF58476D1CE4E5B9)
    h ^= (h >> 27) & ((1 << 37) - 1)
    h *= _to_signed(0x94D049BB133111EB)
    h ^= (h >> 31) & ((1 << 33) - 1)
    return h


def _as_words(chunk: torch.Tensor, words: int, pad_buf: torch.Tensor) -> torch.Tensor:
    """The rows of `chunk` (any layout) as [n, words] int64: a view when the rows are
    dense and 8-byte aligned, else a copy into `pad_buf` with zeroed padding."""
    n = chunk.shape[0]
    width = math.prod(chunk.shape[1:])
    flat = chunk.reshape(n, width)  # a view for 2-D tables, whatever their strides
    if flat.dtype == torch.bool:  # copy bytes as they are (a bool copy may normalize them)
        flat = flat.view(torch.uint8)
    nbytes = width * flat.element_size()
    if nbytes == words * 8 and flat.is_contiguous():
        try:
            return flat.view(torch.int64) if width else flat.view(n, 0)
        except RuntimeError:  # storage offset not 8-byte aligned: fall through to a copy
            pass
    padded = pad_buf[: n * words].view(n, words)
    if nbytes != words * 8:
        padded[:, -1].zero_()  # the padding lies in the last word of each row
    # Copy typed elements (not bytes): one strided element copy instead of itemsize.
    padded.view(flat.dtype)[:, :width].copy_(flat)
    return padded


def row_fingerprints(table: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 tensor [rows] on table.device: a 64-bit hash of each row's bytes.

    Rows are dim 0; any ndim >= 1, any dtype (bool, ints, floats incl. bf16), contiguous or
    not, and rows of zero bytes are accepted. Equal row bytes give equal fingerprints on
    every device; the result depends only on the bytes, not on dtype or shape.
    `out`, when given, must be an int64 tensor of shape [rows] on the table's device.
    """
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"row_fingerprints expects a torch.Tensor, got {type(table).__name__}")
    if table.ndim < 1:
        raise ValueError("row_fingerprints needs a tensor with ndim >= 1 (rows are dim 0)")
    if table.is_quantized or table.layout != torch.strided:
        raise ValueError(f"row_fingerprints cannot hash a {table.dtype} {table.layout} tensor")
    rows = table.shape[0]
    device = table.device
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=device)
    elif out.dtype != torch.int64 or tuple(out.shape) != (rows,) or out.device != device:
        raise ValueError(
            f"out must be int64 [{rows}] on {device}, got {out.dtype} {list(out.shape)} "
            f"on {out.device}"
        )
    nbytes = _row_nbytes(table)
    words = (nbytes + 7) // 8
    if rows == 0:
        return out
    # Contiguous row ranges: each part's fingerprints are those of its rows alone.
    in_parts(rows, _split_parts(device, rows, nbytes),
             lambda lo, hi: _finish(table[lo:hi], words, nbytes, out[lo:hi]))
    return out


def in_parts(rows: int, parts: int, fn: Callable[[int, int], T]) -> list[T]:
    """``[fn(lo, hi)]`` over ``parts`` contiguous row ranges of ``rows``, in order: the
    first on this thread, the others on ``_pool()`` (a row pass on every core)."""
    bounds = [rows * i // parts for i in range(parts + 1)]
    futures = [_pool().submit(fn, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
    return [fn(bounds[0], bounds[1])] + [f.result() for f in futures]


def _split_parts(device: torch.device, rows: int, nbytes: int) -> int:
    if device.type != "cpu" or rows * nbytes < _SPLIT_MIN_BYTES:
        return 1
    return min(_cores(), rows)


def _cores() -> int:
    return min(8, cores())


def _pool() -> ThreadPoolExecutor:
    """Threads hashing the other parts of a large table. A part never waits for another
    task, so callers on many threads share it without a deadlock: each also hashes a part
    itself."""
    global _split_pool
    with _split_lock:
        if _split_pool is None:
            _split_pool = thread_pool(max(1, _cores() - 1), "cnrstore-fp-part")
        return _split_pool


def _finish(table: torch.Tensor, words: int, nbytes: int, out: torch.Tensor) -> None:
    """Fingerprints of ``table``'s rows (at least one) into ``out``."""
    if table.device.type == "cpu" and _native_rows(table, words, nbytes, out):
        return
    if words == 0:
        out.zero_()
    else:
        _hash_words(table, words, out)
    step = _CUDA_CHUNK_WORDS if table.device.type == "cuda" else _CPU_CHUNK_WORDS
    for start in range(0, out.shape[0], step):  # chunked for the same reason as the words
        part = out[start : start + step]
        part ^= _to_signed(nbytes * _LEN_MUL)
        _avalanche(part)


def _native_rows(table: torch.Tensor, words: int, nbytes: int, out: torch.Tensor) -> bool:
    """Hash ``table``'s rows with the compiled one-pass kernel (native.py) when it is
    loaded and each row's bytes are dense (rows may be any stride apart); False: not
    done, use the torch/numpy loop."""
    kernels = native.kernel()
    if kernels is None:
        return False
    fn = kernels.fingerprint
    n = table.shape[0]
    try:
        flat = table.view(n, math.prod(table.shape[1:]))
    except RuntimeError:  # the row's elements are not one dense run
        return False
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        return False
    a, b = _keys(table.device, words)
    dst = out if out.is_contiguous() else torch.empty(n, dtype=torch.int64)
    fn(flat.data_ptr(), n, flat.stride(0) * flat.element_size(), nbytes, a.data_ptr(),
       b.data_ptr(), (nbytes * _LEN_MUL) & _MASK64, dst.data_ptr())
    if dst is not out:
        out.copy_(dst)
    return True


def _cpu_word_view(table: torch.Tensor, words: int) -> np.ndarray | None:
    """The rows as uint64 [rows, words] numpy view, when they are dense, 8-byte words and
    8-byte aligned; else None."""
    if table.device.type != "cpu" or words * 8 != _row_nbytes(table):
        return None
    flat = table.reshape(table.shape[0], math.prod(table.shape[1:]))
    if not flat.is_contiguous():
        return None
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    try:
        return flat.view(torch.int64).numpy().view(np.uint64)
    except (RuntimeError, TypeError):  # misaligned storage offset, or no numpy dtype
        return None


def _hash_words_numpy(w: np.ndarray, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    """The same integer steps as the torch loop below, in numpy uint64 (wrapping, logical
    shifts): numpy dispatches an op in ~1 us against torch's ~5-10 us, which on 128 KiB
    chunks made the torch loop half overhead (2.3 vs 1.2 GB/s per core measured here).
    The keys a_j are tiled to a chunk's shape (a broadcast xor ran at a third of the speed
    of a dense one) and the multiply by b_j and the row sum are one einsum (wrapping uint64
    like the rest): 5.6 against 3.6 GB/s per core on 256 B rows."""
    words = w.shape[1]
    bn = b.numpy().view(np.uint64)
    res = out.numpy().view(np.uint64)
    c = np.uint64(_C)
    chunk_rows = max(1, _CPU_CHUNK_WORDS * 2 // words)
    rows = min(chunk_rows, w.shape[0])
    an = np.ascontiguousarray(np.broadcast_to(a.numpy().view(np.uint64), (rows, words)))
    x = np.empty((rows, words), dtype=np.uint64)
    y = np.empty_like(x)
    for start in range(0, w.shape[0], chunk_rows):
        src = w[start : start + chunk_rows]
        n = src.shape[0]
        xx, yy = x[:n], y[:n]
        np.bitwise_xor(src, an[:n], out=xx)
        np.multiply(xx, c, out=xx)
        np.right_shift(xx, np.uint64(32), out=yy)
        np.bitwise_xor(xx, yy, out=xx)
        np.einsum("ij,j->i", xx, bn, out=res[start : start + n])


def _hash_words(table: torch.Tensor, words: int, out: torch.Tensor) -> None:
    device = table.device
    a, b = _keys(device, words)
    w = _cpu_word_view(table, words)
    if w is not None:
        _hash_words_numpy(w, a, b, out)
        return
    if device.type == "cuda":
        budget = _CUDA_CHUNK_WORDS
    elif table.is_contiguous() and words * 8 == _row_nbytes(table):
        budget = _CPU_CHUNK_WORDS
    else:  # rows are copied into the padded buffer: keep that copy serial too
        budget = min(_CPU_CHUNK_WORDS, _SERIAL_ELEMS * table.element_size() // 8)
    chunk_rows = max(1, budget // words)
    elems = min(chunk_rows, table.shape[0]) * words
    work, tmp, pad = _take_buffers(device, elems)
    c = _to_signed(_C)
    mask32 = (1 << 32) - 1
    try:
        for start in range(0, table.shape[0], chunk_rows):
            # Chunk before flattening: a non-contiguous table is copied a chunk at a time.
            chunk = table[start : start + chunk_rows]
            n = chunk.shape[0]
            wt = _as_words(chunk, words, pad)
            x = work[: n * words].view(n, words)
            y = tmp[: n * words].view(n, words)
            torch.bitwise_xor(wt, a, out=x)
            x *= c
            torch.bitwise_right_shift(x, 32, out=y)
            y &= mask32
            x ^= y
            x *= b
            torch.sum(x, dim=1, out=out[start : start + n])
    finally:
        _return_buffers(device, (work, tmp, pad))

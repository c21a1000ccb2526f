"""Bit-packing of per-row integer codes (1..8 bits) into bytes, on any device.

Layout (normative, docs/QUANTIZATION.md "Row encoding"): a row's codes are taken in groups
of 8; group g holds codes c_0..c_7 as the little-endian integer sum(c_i << (bits * i)),
written as `bits` bytes. A row of `width` codes thus packs into ceil(width * bits / 8)
bytes: the last group is zero-padded and its trailing all-padding bytes are dropped.
For bits = 8 the packed row is the codes themselves; for 4 bits code 2k is the low nibble of
byte k; for 3 bits every 8 codes take exactly 3 bytes.
"""

from __future__ import annotations

import torch

from cnrstore.codec.layout import packed_nbytes

__all__ = ["packed_nbytes", "pack_codes", "unpack_codes"]

_BITS = range(1, 9)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or bits not in _BITS:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [n, width] codes (each < 2**bits) -> uint8 [n, packed_nbytes(width, bits)].

    Codes are not range-checked (the encoder clamps them); higher bits would bleed into the
    neighbouring code.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8 or codes.ndim != 2:
        raise ValueError(f"codes must be a 2-D uint8 tensor, got {codes.dtype} {codes.ndim}-D")
    if bits == 8:
        return codes.contiguous()
    n, width = codes.shape
    nbytes = packed_nbytes(width, bits)
    if 8 % bits == 0:
        # Whole codes per byte: uint8 shifts and ORs only (the hot path for int4/int2).
        per_byte = 8 // bits
        grouped = _pad_columns(codes, nbytes * per_byte, torch.uint8).view(n, nbytes, per_byte)
        out = grouped[:, :, 0].clone()
        for i in range(1, per_byte):
            out |= grouped[:, :, i] << (bits * i)
        return out
    groups = (width + 7) // 8
    wide = torch.int32 if bits * 8 <= 31 else torch.int64
    grouped = _pad_columns(codes, groups * 8, wide).view(n, groups, 8)
    # Codes of a group occupy disjoint bit ranges, so OR-ing never carries.
    value = grouped[:, :, 0].clone()
    for i in range(1, 8):
        value |= grouped[:, :, i] << (bits * i)
    out = torch.empty((n, groups, bits), dtype=torch.uint8, device=codes.device)
    for k in range(bits):
        out[:, :, k] = (value >> (8 * k)) & 0xFF
    return out.view(n, groups * bits)[:, :nbytes].contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """uint8 [n, packed_nbytes(width, bits)] -> uint8 [n, width] codes (8 bits: ``packed``
    itself, which may be a strided view)."""
    _check_bits(bits)
    nbytes = packed_nbytes(width, bits)
    if packed.dtype != torch.uint8 or packed.ndim != 2 or packed.shape[1] != nbytes:
        raise ValueError(
            f"packed must be uint8 [n, {nbytes}] for {width} codes of {bits} bits, got "
            f"{packed.dtype} {list(packed.shape)}"
        )
    if bits == 8:
        return packed
    n = packed.shape[0]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per_byte = 8 // bits
        out = torch.empty((n, nbytes, per_byte), dtype=torch.uint8, device=packed.device)
        for i in range(per_byte):
            torch.bitwise_and(packed >> (bits * i), mask, out=out[:, :, i])
        return out.view(n, nbytes * per_byte)[:, :width].contiguous()
    groups = (width + 7) // 8
    wide = torch.int32 if bits * 8 <= 31 else torch.int64
    full = _pad_columns(packed, groups * bits, wide).view(n, groups, bits)
    value = full[:, :, 0].clone()
    for k in range(1, bits):
        value |= full[:, :, k] << (8 * k)
    out = torch.empty((n, groups, 8), dtype=torch.uint8, device=packed.device)
    for i in range(8):
        out[:, :, i] = (value >> (bits * i)) & mask
    return out.view(n, groups * 8)[:, :width].contiguous()


def _pad_columns(t: torch.Tensor, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """t as `dtype`, zero-padded on the right to `columns` columns (contiguous)."""
    if t.shape[1] == columns:
        return t.to(dtype).contiguous()
    out = torch.zeros((t.shape[0], columns), dtype=dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out

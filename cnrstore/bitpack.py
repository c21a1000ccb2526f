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

__all__ = ["packed_nbytes", "pack_codes", "unpack_codes"]

_BITS = range(1, 9)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or bits not in _BITS:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")


def packed_nbytes(width: int, bits: int) -> int:
    """Bytes that `width` codes of `bits` bits take in a packed row."""
    _check_bits(bits)
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    return (width * bits + 7) // 8


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
    groups = (width + 7) // 8
    padded = torch.zeros((n, groups * 8), dtype=torch.int64, device=codes.device)
    padded[:, :width] = codes
    grouped = padded.view(n, groups, 8)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=codes.device)
    # Codes of a group occupy disjoint bit ranges, so the sum is an OR and never carries.
    value = (grouped << shifts).sum(dim=2, keepdim=True)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=codes.device)
    out = ((value >> byte_shifts) & 0xFF).to(torch.uint8).view(n, groups * bits)
    return out[:, :nbytes].contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """uint8 [n, packed_nbytes(width, bits)] -> uint8 [n, width] codes."""
    _check_bits(bits)
    nbytes = packed_nbytes(width, bits)
    if packed.dtype != torch.uint8 or packed.ndim != 2 or packed.shape[1] != nbytes:
        raise ValueError(
            f"packed must be uint8 [n, {nbytes}] for {width} codes of {bits} bits, got "
            f"{packed.dtype} {list(packed.shape)}"
        )
    if bits == 8:
        return packed.contiguous()
    n = packed.shape[0]
    groups = (width + 7) // 8
    full = torch.zeros((n, groups * bits), dtype=torch.int64, device=packed.device)
    full[:, :nbytes] = packed
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=packed.device)
    value = (full.view(n, groups, bits) << byte_shifts).sum(dim=2, keepdim=True)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=packed.device)
    codes = ((value >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    return codes.view(n, groups * 8)[:, :width].contiguous()

"""Table dtypes and the sizes of encoded rows, computed from names alone.

What a reader needs to check a table node before it allocates anything (scheme, dtype,
bytes per row) is arithmetic on names and widths. It lives here, below quantize.py and
bitpack.py (which re-export it), so that the manifest decodes, and ``cnrstore ls``,
``show``, ``du``, ``diff`` and ``verify`` run, without importing torch. Byte layouts:
docs/QUANTIZATION.md ("Row encoding"). Torch is imported only to map dtype names to
torch dtypes (``DTYPES``, ``parse_dtype``), on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cnrstore.errors import ManifestError

if TYPE_CHECKING:
    import torch

    DTYPES: dict[str, torch.dtype]

__all__ = [
    "SCHEMES",
    "DTYPE_SIZES",
    "DTYPES",
    "dtype_name",
    "parse_dtype",
    "LOSSY_DTYPE_NAMES",
    "HEADER_NBYTES",
    "WIDE_HEADER_NBYTES",
    "check_scheme_name",
    "packed_nbytes",
    "row_nbytes_of",
    "row_nbytes_options_of",
]

SCHEMES = ("exact", "fp16", "bf16", "int8", "int4", "int3", "int2")
BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
CAST_SCHEMES = ("fp16", "bf16")
# The table dtypes a table node may name, with their bytes per element (docs/MANIFEST.md,
# "Table node"): the manifest's allow-list.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
# Names are looked up here, never with getattr on torch: a crafted node naming "__class__"
# got a type back, and one naming "_dynamo" imported a torch submodule.
_DTYPES: dict[str, torch.dtype] = {}  # DTYPES, filled on first use
LOSSY_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
# fp16 scale then fp16 offset, little-endian, ahead of the packed codes.
HEADER_NBYTES = 4
# fp32 scale then fp32 offset: "wide" rows (docs/QUANTIZATION.md, "Wide rows").
WIDE_HEADER_NBYTES = 8


def __getattr__(name: str) -> Any:  # PEP 562: DTYPES imports torch when first asked for
    if name != "DTYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _DTYPES:
        import torch

        _DTYPES.update((n, getattr(torch, n)) for n in DTYPE_SIZES
                       if isinstance(getattr(torch, n, None), torch.dtype))
    return _DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype a node names; ManifestError for names outside the allow-list."""
    dtype = __getattr__("DTYPES").get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ManifestError(f"unknown table dtype {name!r}")
    return dtype


def check_scheme_name(scheme: str, dtype: str, *, table: str) -> None:
    """Raise ValueError (naming table, scheme and dtype) unless ``scheme`` can encode a
    table of the dtype named ``dtype`` ("float32", ...)."""
    if not isinstance(scheme, str) or scheme not in SCHEMES:
        raise ValueError(
            f"table {table!r}: unknown quantization scheme {scheme!r}; "
            f"expected one of {', '.join(SCHEMES)}"
        )
    if scheme != "exact" and dtype not in LOSSY_DTYPE_NAMES:
        raise ValueError(
            f"table {table!r}: scheme {scheme!r} is lossy and needs a float32, float16, "
            f"bfloat16 or float64 table, but the table is torch.{dtype}; use 'exact'"
        )


def packed_nbytes(width: int, bits: int) -> int:
    """Bytes that `width` codes of `bits` bits take in a packed row."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    return (width * bits + 7) // 8


def row_nbytes_of(scheme: str, dtype: str, width: int, *, itemsize: int | None = None,
                  wide: bool = False) -> int:
    """Bytes of one encoded row of ``width`` elements of the dtype named ``dtype`` under
    ``scheme`` (``wide``: intN rows with fp32 scale/offset). ``itemsize`` overrides the
    allow-list's element size (for dtypes outside it, which only "exact" takes)."""
    check_scheme_name(scheme, dtype, table="<row_nbytes>")
    if not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be an int >= 0, got {width!r}")
    if scheme == "exact":
        return width * (itemsize if itemsize is not None else DTYPE_SIZES[dtype])
    if scheme in CAST_SCHEMES:
        return 2 * width
    head = WIDE_HEADER_NBYTES if wide else HEADER_NBYTES
    return head + packed_nbytes(width, BITS[scheme])


def row_nbytes_options_of(scheme: str, dtype: str, width: int, *,
                          itemsize: int | None = None) -> tuple[int, ...]:
    """The row sizes a stored table of this scheme, dtype name and width may have."""
    narrow = row_nbytes_of(scheme, dtype, width, itemsize=itemsize)
    if scheme in BITS:
        return (narrow, row_nbytes_of(scheme, dtype, width, itemsize=itemsize, wide=True))
    return (narrow,)

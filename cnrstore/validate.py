"""Up-front validation of put arguments: everything a put can refuse is refused here, before
any fingerprint is computed or any byte written (DESIGN.md, "Bad input gets a clear error").
NaN/Inf under lossy schemes is checked where the rows are gathered (snapshot.py), still
before anything changes."""

from __future__ import annotations

from collections.abc import Mapping

import msgpack
import torch

from .errors import InvalidInput, InvalidType
from .quantspec import resolve_quant  # noqa: F401 - re-exported: patterns live there

__all__ = ["check_step", "check_tables", "resolve_quant", "pack_metadata", "check_touched"]


def check_step(step) -> int:
    if not isinstance(step, int) or isinstance(step, bool):
        raise InvalidType(f"step must be an int, got {type(step).__name__}")
    if step < 0:
        raise InvalidInput(f"step must be >= 0, got {step}")
    if step >= 10**20:
        raise InvalidInput(f"step must be < 10**20, got {step}")
    return step


def check_tables(tables) -> None:
    if not isinstance(tables, Mapping):
        raise InvalidType(f"tables must be a mapping name -> tensor, got {type(tables).__name__}")
    for name, value in tables.items():
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"table names must be non-empty strings, got {name!r}")
        if not isinstance(value, torch.Tensor):
            raise InvalidType(f"table {name!r} must be a torch.Tensor, got {type(value).__name__}")
        if value.ndim < 1:
            raise InvalidInput(f"table {name!r} has ndim 0; a table needs rows (ndim >= 1)")
        if value.is_sparse or value.is_quantized or value.is_complex():
            raise InvalidInput(f"table {name!r}: sparse, quantized or complex tensors unsupported")


def pack_metadata(metadata) -> dict:
    """The user metadata as stored (a msgpack map), checked to round-trip now."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidType(f"metadata must be a mapping, got {type(metadata).__name__}")
    doc = dict(metadata)
    try:
        msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInput(f"metadata is not msgpack-serializable: {exc}") from exc
    return doc


def check_touched(touched, tables: Mapping) -> dict[str, torch.Tensor]:
    """Touched row ids per table as int64 tensors on each table's device."""
    if touched is None:
        return {}
    if not isinstance(touched, Mapping):
        raise InvalidType(f"touched must be a mapping name -> row ids, got {type(touched)}")
    out = {}
    for name, ids in touched.items():
        if name not in tables:
            raise InvalidInput(f"touched names table {name!r} that is not in this put")
        table = tables[name]
        try:
            t = torch.as_tensor(ids, device=table.device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidType(f"touched[{name!r}] is not a sequence of row ids: {exc}") from exc
        if t.ndim == 1 and t.numel() == 0:
            t = t.to(torch.int64)
        if t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InvalidType(f"touched[{name!r}] must be a 1-D integer sequence of row ids")
        t = t.to(torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= table.shape[0]):
            raise InvalidInput(f"touched[{name!r}] has row ids outside 0..{table.shape[0] - 1}")
        out[name] = t
    return out

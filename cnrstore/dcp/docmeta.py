"""DCP's checkpoint metadata as a cnrstore step keeps it: a msgpack document in the step's
metadata under ``"dcp"``, and back to a ``torch.distributed.checkpoint.Metadata``.

The document (version 1):

    {"version": 1,
     "tensors": {fqn: [dtype, [size...], requires_grad, pin_memory]},
     "bytes": {fqn: the bytes DCP gave (a torch.save of the Python value)},
     "planner_data": {fqn: [key, ...]} or None}

Each tensor is the table named ``fqn``, whole (a 0-dim tensor is a 1-row table). DCP's
planner reshards on load from chunk metadata; cnrstore reads any rows of a table, so the
metadata it gives back says each tensor is one chunk and every read names rows of it.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from cnrstore.codec.layout import DTYPE_SIZES, dtype_name, parse_dtype
from cnrstore.errors import InvalidInput, ManifestError

__all__ = ["KEY", "build", "to_metadata", "table_shape"]

KEY = "dcp"
VERSION = 1


def table_shape(size: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """The stored table's shape for a tensor of ``size`` (a scalar is one row)."""
    return tuple(size) if len(size) else (1,)


def _planner_data(plans: list[SavePlan]) -> dict | None:
    """The default planner's mapping fqn -> path of keys, msgpack-able; another planner's
    data is not kept (its loads do not read it back from storage)."""
    parts = [p.planner_data for p in plans if isinstance(p.planner_data, Mapping)]
    if not parts:
        return None
    out: dict[str, list] = {}
    merged: dict[Any, Any] = dict(ChainMap(*[dict(p) for p in parts]))
    for fqn, path in merged.items():
        if not isinstance(fqn, str) or not isinstance(path, (tuple, list)) or not all(
                isinstance(k, (str, int)) and not isinstance(k, bool) for k in path):
            return None
        out[fqn] = list(path)
    return out


def build(plans: list[SavePlan]) -> dict:
    """The document of a save from every rank's final plan (on the coordinator); the
    ``bytes`` entries are filled in write_data, where DCP hands the values over."""
    tensors: dict[str, list] = {}
    byte_items: dict[str, None] = {}
    for plan in plans:
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                byte_items[fqn] = None
                continue
            td = item.tensor_data
            assert td is not None
            props = td.properties
            entry = [dtype_name(props.dtype), [int(n) for n in td.size],
                     bool(props.requires_grad), bool(props.pin_memory)]
            if entry[0] not in DTYPE_SIZES:
                raise InvalidInput(f"DCP save: {fqn!r}: dtype {props.dtype} cannot be stored")
            if tensors.setdefault(fqn, entry) != entry:
                raise InvalidInput(f"DCP save: ranks describe {fqn!r} differently "
                                   f"({tensors[fqn]} and {entry})")
    both = sorted(set(tensors) & set(byte_items))
    if both:
        raise InvalidInput(f"DCP save: {both[0]!r} is a tensor on one rank and a Python "
                           "value on another")
    return {"version": VERSION, "tensors": tensors, "bytes": dict(byte_items),
            "planner_data": _planner_data(plans)}


def to_metadata(doc: Any, step: int) -> Metadata:
    """The DCP Metadata of a step's document (ManifestError for one that is malformed)."""
    version = doc.get("version") if isinstance(doc, Mapping) else doc
    if version != VERSION:
        raise ManifestError(f"step {step}: its DCP metadata has an unknown layout "
                            f"(version {version!r})")
    try:
        md: dict[str, Any] = {}
        for fqn, (dtype, size, requires_grad, pin_memory) in doc["tensors"].items():
            props = TensorProperties(dtype=parse_dtype(dtype), requires_grad=bool(requires_grad),
                                     pin_memory=bool(pin_memory))
            shape = torch.Size([int(n) for n in size])
            md[fqn] = TensorStorageMetadata(
                properties=props, size=shape,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)])
        for fqn, value in doc["bytes"].items():
            if not isinstance(value, bytes):
                raise TypeError(f"value {fqn!r} is not bytes")
            md[fqn] = BytesStorageMetadata()
        planner = doc.get("planner_data")
        planner = None if planner is None else {k: tuple(v) for k, v in planner.items()}
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ManifestError(f"step {step}: its DCP metadata is malformed: {exc}") from None
    return Metadata(state_dict_metadata=md, planner_data=planner)

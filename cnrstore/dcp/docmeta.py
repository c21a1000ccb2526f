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

from cnrstore.errors import InvalidInput

__all__ = ["KEY", "build", "to_metadata", "table_shape", "dtype_name", "parse_dtype"]

KEY = "dcp"
VERSION = 1


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInput(f"DCP metadata names an unknown dtype {name!r}")
    return dtype


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
    """The DCP Metadata of a step's document."""
    if not isinstance(doc, Mapping) or doc.get("version") != VERSION:
        raise InvalidInput(f"step {step}: its DCP metadata has an unknown layout "
                           f"(version {doc.get('version') if isinstance(doc, Mapping) else doc!r})")
    md: dict[str, Any] = {}
    for fqn, (dtype, size, requires_grad, pin_memory) in doc["tensors"].items():
        props = TensorProperties(dtype=parse_dtype(dtype), requires_grad=requires_grad,
                                 pin_memory=pin_memory)
        shape = torch.Size(size)
        md[fqn] = TensorStorageMetadata(
            properties=props, size=shape,
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=shape)])
    for fqn in doc["bytes"]:
        md[fqn] = BytesStorageMetadata()
    planner = doc.get("planner_data")
    return Metadata(state_dict_metadata=md,
                    planner_data=None if planner is None else
                    {k: tuple(v) for k, v in planner.items()})

"""Whole training state: flatten a nesting of dicts/lists/tuples into tables plus a
structure document, and build the nesting back (docs/MANIFEST.md, "State").

A state is any nesting of dicts (str or int keys), lists and tuples. Tensor leaves become
tables named by their path joined with "/" (``model/emb.weight``, ``optim/state/0/sum``);
a 0-dim tensor is stored as a 1-row table and its shape kept in the structure. Python
leaves (None, bool, int, float, str, bytes) are kept in the structure itself, which goes
into the step node, so they come back with the key types, container types and dict order
they went in with -- what ``load_state_dict`` of torch modules and optimizers needs.

Structure document (msgpack, one map per node):

    {"d": [[key, node], ...]}   dict, in order; key an int or a str
    {"l": [node, ...]}          list
    {"t": [node, ...]}          tuple
    {"T": name, "shape": [...]} tensor leaf: table ``name``, original shape
    {"p": value}                Python leaf
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import torch

from cnrstore.core.validate import is_shard, not_a_tensor
from cnrstore.errors import InvalidInput, InvalidType, ManifestError

__all__ = ["FlatState", "flatten", "unflatten", "fill", "lazy_tables", "stored_leaf",
           "check_structure", "merge_structures"]

_SCALARS = (type(None), bool, int, float, str, bytes)
SEP = "/"
MAX_DEPTH = 64


class FlatState:
    """A flattened state: ``tables`` (name -> tensor of ndim >= 1, views of the leaves),
    ``shapes`` (name -> the leaf's own shape) and ``doc``, the structure document."""

    __slots__ = ("tables", "shapes", "doc")

    def __init__(self, tables: dict, shapes: dict, doc: dict):
        self.tables = tables
        self.shapes = shapes
        self.doc = doc


def _key_text(key, path: str) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise InvalidType(
            f"state key {key!r} at {path or '<root>'!r} is a {type(key).__name__}; "
            "keys must be str or int"
        )
    text = str(key)
    if isinstance(key, str):
        if not key:
            raise InvalidInput(f"state key at {path or '<root>'!r} is an empty string")
        if SEP in key:
            raise InvalidInput(
                f"state key {key!r} at {path or '<root>'!r} contains {SEP!r}, which "
                "joins the path of a table name; rename the key"
            )
    return text


def flatten(state) -> FlatState:
    """Split ``state`` into tables and a structure document. Raises InvalidInput or
    InvalidType (naming the path) before anything is written."""
    if not isinstance(state, (Mapping, list, tuple)):
        raise InvalidType(f"state must be a dict, list or tuple, got {type(state).__name__}")
    tables: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}

    def walk(value, path: str, depth: int):
        if depth > MAX_DEPTH:
            raise InvalidInput(f"state nests deeper than {MAX_DEPTH} at {path!r} (a cycle?)")
        if isinstance(value, torch.Tensor):
            if not path:
                raise InvalidType("state must be a dict, list or tuple, not a tensor")
            if path in tables:
                raise InvalidInput(f"two state entries map to the table name {path!r} "
                                   "(an int key and a str key of the same text?)")
            tables[path] = value.detach().reshape(1) if value.ndim == 0 else value.detach()
            shapes[path] = tuple(value.shape)
            return {"T": path, "shape": list(value.shape)}
        if isinstance(value, Mapping):
            items = []
            for key, child in value.items():
                text = _key_text(key, path)
                items.append([key, walk(child, f"{path}{SEP}{text}" if path else text,
                                        depth + 1)])
            return {"d": items}
        if isinstance(value, (list, tuple)):
            kind = "t" if isinstance(value, tuple) else "l"
            return {kind: [walk(child, f"{path}{SEP}{i}" if path else str(i), depth + 1)
                           for i, child in enumerate(value)]}
        if isinstance(value, _SCALARS):
            if isinstance(value, int) and not isinstance(value, bool) and not (
                -(1 << 63) <= value < (1 << 64)
            ):
                raise InvalidInput(f"state value at {path!r} is an int beyond 64 bits")
            return {"p": value}
        if is_shard(value):
            raise not_a_tensor(f"state value at {path!r}", value)
        raise InvalidType(
            f"state value at {path!r} is a {type(value).__name__}; leaves must be tensors "
            "or None/bool/int/float/str/bytes"
        )

    doc = walk(state, "", 0)
    try:
        msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # pragma: no cover - checked above
        raise InvalidInput(f"state is not msgpack-serializable: {exc}") from exc
    return FlatState(tables, shapes, doc)


def check_structure(doc) -> dict[str, tuple[int, ...]]:
    """Tensor leaves of a stored structure document: table name -> original shape.
    Raises ManifestError when the document is malformed."""
    out: dict[str, tuple[int, ...]] = {}

    def walk(node, depth: int) -> None:
        if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) not in (1, 2):
            raise ManifestError("malformed state structure node")
        if "T" in node:
            shape = node.get("shape")
            if (not isinstance(node["T"], str) or not isinstance(shape, list)
                    or not all(isinstance(d, int) and d >= 0 for d in shape)):
                raise ManifestError("malformed state tensor leaf")
            out[node["T"]] = tuple(shape)
        elif "p" in node:
            pass
        elif "d" in node:
            for item in node["d"]:
                if not isinstance(item, list) or len(item) != 2 or isinstance(item[0], bool) \
                        or not isinstance(item[0], (str, int)):
                    raise ManifestError("malformed state dict entry")
                walk(item[1], depth + 1)
        elif "l" in node or "t" in node:
            children = node.get("l", node.get("t"))
            if not isinstance(children, list):
                raise ManifestError("malformed state sequence")
            for child in children:
                walk(child, depth + 1)
        else:
            raise ManifestError(f"unknown state structure node {sorted(node)}")

    walk(doc, 0)
    return out


_KINDS = {"T": "tensor", "p": "Python value", "d": "dict", "l": "list", "t": "tuple"}


def _kind(node: dict) -> str:
    return next(k for k in _KINDS if k in node)


def merge_structures(docs: list[dict]) -> dict:
    """One structure document naming the leaves of all of ``docs`` (one per rank, the
    coordinator's first): dict entries any of them has, in the order of the first that
    has them (keys matched by their text, as table names are); sequences holding tensors
    as long as the longest; where several give the same leaf, the first one's (a Python
    value, or a sequence of Python values only, is the coordinator's). A path that is a
    tensor in one document and anything else in another is InvalidInput: one of them
    would be lost."""

    def tensors(node: dict) -> bool:
        kind = _kind(node)
        if kind == "T":
            return True
        if kind == "d":
            return any(tensors(c) for _, c in node["d"])
        return kind in ("l", "t") and any(tensors(c) for c in node[kind])

    def merge(a: dict, b: dict, path: str, rank: int) -> dict:
        ka, kb = _kind(a), _kind(b)
        if ka != kb:
            if tensors(a) or tensors(b):
                raise InvalidInput(
                    f"state entry {path or '<root>'!r} is a {_KINDS[kb]} on rank {rank} "
                    f"and a {_KINDS[ka]} on a lower rank; every rank must give it as the "
                    "same kind (nothing was written)")
            return a  # Python values only: the lower rank's, as for one value
        if ka == "d":
            items = [[k, c] for k, c in a["d"]]
            at = {str(k): i for i, (k, _) in enumerate(items)}
            for k, c in b["d"]:
                sub = f"{path}{SEP}{k}" if path else str(k)
                if str(k) in at:
                    i = at[str(k)]
                    items[i][1] = merge(items[i][1], c, sub, rank)
                else:
                    at[str(k)] = len(items)
                    items.append([k, c])
            return {"d": items}
        if ka in ("l", "t"):
            if not tensors(b):  # a list of Python values (a param group's "params") is
                return a        # one value: the lower rank's, not spliced from several
            sa, sb = a[ka], b[ka]
            both = [merge(x, y, f"{path}{SEP}{i}" if path else str(i), rank)
                    for i, (x, y) in enumerate(zip(sa, sb))]
            return {ka: both + sa[len(sb):] + sb[len(sa):]}
        return a

    out = docs[0]
    for rank, doc in enumerate(docs[1:], start=1):
        out = merge(out, doc, "", rank)
    return out


def unflatten(doc: dict, tensor: Callable[[str, tuple[int, ...]], torch.Tensor]):
    """Build the nesting of ``doc``; ``tensor(name, shape)`` supplies each tensor leaf."""

    def build(node):
        if "T" in node:
            return tensor(node["T"], tuple(node["shape"]))
        if "p" in node:
            return node["p"]
        if "d" in node:
            return {key: build(child) for key, child in node["d"]}
        if "l" in node:
            return [build(child) for child in node["l"]]
        return tuple(build(child) for child in node["t"])

    return build(doc)


def _sequence(doc: dict) -> list | None:
    return doc.get("l", doc.get("t")) if ("l" in doc or "t" in doc) else None


def _lazy(given, doc: dict) -> bool:
    """True where ``given`` is an empty dict or list and the stored node a non-empty one:
    a container its owner fills lazily (torch.optim's Adam and SGD create their "state"
    at the first ``step()``), so the stored entries are adopted, not left out."""
    if isinstance(given, Mapping):
        return not given and bool(doc.get("d"))
    if isinstance(given, (list, tuple)):
        return not given and bool(_sequence(doc))
    return False


def lazy_tables(given, doc: dict, *, is_tensor: Callable[[Any], bool] | None = None
                ) -> dict[str, tuple[int, ...]]:
    """Table name -> shape of the stored tensor leaves that ``fill`` adopts into the empty
    containers of ``given`` (``_lazy``): they are read fresh, as get_state reads them."""
    out: dict[str, tuple[int, ...]] = {}

    def walk(g, d) -> None:
        if not isinstance(d, dict) or isinstance(g, torch.Tensor) or (
                is_tensor is not None and is_tensor(g)):
            return
        if _lazy(g, d):
            out.update(check_structure(d))
        elif isinstance(g, Mapping) and "d" in d:
            stored = {key: child for key, child in d["d"]}
            for key, child in g.items():
                if key in stored:
                    walk(child, stored[key])
        elif isinstance(g, (list, tuple)) and _sequence(d) is not None:
            for c, sub in zip(g, _sequence(d) or []):
                walk(c, sub)

    walk(given, doc)
    return out


def stored_leaf(step: int, tables: Mapping[str, torch.Tensor]
                ) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """``unflatten``'s tensor leaf from the tables read for a step: each in the shape its
    leaf was put with (a 0-dim tensor was stored as one row)."""

    def leaf(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = tables[name]
        if t.numel() != math.prod(shape):
            raise ManifestError(f"step {step}: table {name!r} holds {tuple(t.shape)}, its "
                                f"state leaf says {shape}")
        return t.reshape(shape)

    return leaf


def fill(given, doc: dict, *, strict: bool, path: str = "",
         is_tensor: Callable[[Any], bool] | None = None,
         adopt: Callable[[dict], Any] | None = None):
    """``given`` with its Python leaves replaced by the stored ones of ``doc`` (tensors are
    kept: the caller restored them in place). Containers are rebuilt with the given types;
    entries ``doc`` lacks are kept as they are (strict checking happens before).
    ``is_tensor``: what else the caller restored in place as a tensor leaf (the
    distributed store's Shards). ``adopt(node)``: the stored subtree for an empty
    container of ``given`` that the store holds filled (``lazy_tables``), or None to keep
    it empty; without ``adopt`` such containers stay empty."""
    if isinstance(given, torch.Tensor) or (is_tensor is not None and "T" in doc
                                           and is_tensor(given)):
        return given
    if adopt is not None and _lazy(given, doc):
        adopted = adopt(doc)
        if adopted is not None:
            return adopted
    if isinstance(given, Mapping) and "d" in doc:
        stored = {key: child for key, child in doc["d"]}
        out: Any = copy.copy(given)  # keeps the mapping's type and attributes (state_dict metadata)
        for key, child in given.items():
            text = _key_text(key, path)
            sub = f"{path}{SEP}{text}" if path else text
            if key in stored:
                out[key] = fill(child, stored[key], strict=strict, path=sub,
                                is_tensor=is_tensor, adopt=adopt)
            elif strict:
                raise InvalidInput(f"state entry {sub!r} is not in the stored state")
        return out
    if isinstance(given, (list, tuple)) and ("l" in doc or "t" in doc):
        seq = doc.get("l", doc.get("t")) or []
        if strict and len(given) > len(seq):
            raise InvalidInput(f"state entry {path!r} has {len(given)} items, the stored "
                               f"state {len(seq)}")
        items = [fill(c, seq[i], strict=strict, path=f"{path}{SEP}{i}" if path else str(i),
                      is_tensor=is_tensor, adopt=adopt)
                 if i < len(seq) else c for i, c in enumerate(given)]
        return tuple(items) if isinstance(given, tuple) else items
    if "p" in doc:
        return doc["p"]
    if strict:
        raise InvalidInput(f"state entry {path!r} does not match the stored structure")
    return given

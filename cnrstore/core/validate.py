"""Up-front validation of put arguments: everything a put can refuse is refused here, before
any fingerprint is computed or any byte written (docs/GUIDE.md, "The API contract": "Bad
input gets a clear error").
NaN/Inf under lossy schemes is checked where the rows are gathered (snapshot.py), still
before anything changes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgpack
import torch

from cnrstore.codec.layout import DTYPES, dtype_name
from cnrstore.core.quantspec import resolve_quant  # noqa: F401 - re-exported: patterns live there
from cnrstore.errors import InvalidInput, InvalidType, ReadOnlyStore
from cnrstore.format.manifest import KIND_STEP, MAX_NDIM, check_node_size

__all__ = [
    "check_step", "check_name", "check_device", "check_table", "check_tables",
    "check_destination", "is_shard", "not_a_tensor", "overlaps", "resolve_quant",
    "pack_metadata", "check_touched", "check_writable", "check_selection",
]


def check_step(step) -> int:
    if not isinstance(step, int) or isinstance(step, bool):
        raise InvalidType(f"step must be an int, got {type(step).__name__}")
    if step < 0:
        raise InvalidInput(f"step must be >= 0, got {step}")
    if step >= MAX_STEP:
        # The step node stores it as a msgpack uint64: a larger step failed only in the
        # background writer (OverflowError), after the put had returned.
        raise InvalidInput(f"step must be < 2**64, got {step}")
    return step


MAX_STEP = 1 << 64


def check_writable(objects, what: str) -> None:
    """ReadOnlyStore before a write to a store opened with readonly=True."""
    if getattr(objects, "readonly", False):
        raise ReadOnlyStore(f"{what}: the store was opened with readonly=True")


def check_name(what: str, name) -> str:
    """A non-empty str that encodes as UTF-8 (manifest nodes store names as msgpack str;
    a lone surrogate failed only in the background writer)."""
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"{what}s must be non-empty strings, got {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} {name!r} is not valid UTF-8 (lone surrogate?): {exc}") from None
    return name


def is_shard(value) -> bool:
    """A ``cnrstore.Shard`` (cnrstore/distributed/shard.py, a layer above: known by name)."""
    cls = type(value)
    return cls.__name__ == "Shard" and cls.__module__ == "cnrstore.distributed.shard"


def not_a_tensor(what: str, value) -> InvalidType:
    """The error for a value that should be a tensor; a Shard is named for what it needs."""
    if is_shard(value):
        return InvalidType(
            f"{what} is a cnrstore.Shard: Shards are for a store opened collectively with "
            "group= (cnrstore.open(path, group=pg)); a plain store takes the whole table "
            "as a tensor")
    return InvalidType(f"{what} must be a torch.Tensor, got {type(value).__name__}")


def check_table(name: str, value) -> None:
    """One tensor of a put: rows, a storable dtype, data, a dense strided layout."""
    if not isinstance(value, torch.Tensor):
        raise not_a_tensor(f"table {name!r}", value)
    if value.layout != torch.strided or value.is_quantized or value.is_complex():
        # is_sparse is true for COO only: a CSR/CSC/BSR tensor failed late, in torch
        raise InvalidInput(f"table {name!r}: {value.layout} (sparse), quantized or complex "
                           "tensors are unsupported; store a dense tensor (.to_dense())")
    if value.ndim < 1:
        raise InvalidInput(f"table {name!r} has ndim 0; a table needs rows (ndim >= 1)")
    if value.ndim > MAX_NDIM:
        raise InvalidInput(f"table {name!r} has {value.ndim} dims; a table node holds "
                           f"at most {MAX_NDIM}")
    if dtype_name(value.dtype) not in DTYPES:
        raise InvalidInput(f"table {name!r}: dtype {value.dtype} cannot be stored")
    if value.is_meta:
        raise InvalidInput(f"table {name!r} is a meta tensor: it holds no data to store")


def check_tables(tables) -> None:
    if not isinstance(tables, Mapping):
        raise InvalidType(f"tables must be a mapping name -> tensor, got {type(tables).__name__}")
    for name, value in tables.items():
        check_name("table name", name)
        check_table(name, value)


def overlaps(t: torch.Tensor) -> bool:
    """True when elements of ``t`` may share memory (an ``expand``ed view, a stride 0, an
    overlapping ``as_strided``): each dimension's stride must pass every offset that the
    smaller-strided dimensions reach, else two indices can land on one element."""
    reach = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_destination(what: str, t) -> None:
    """A tensor a restore writes into in place: checked before anything is written (a
    meta tensor would "restore" nothing; overlapping elements failed in torch midway,
    after earlier tables were written)."""
    if not isinstance(t, torch.Tensor):
        raise not_a_tensor(what, t)
    if t.layout != torch.strided or t.is_quantized:
        raise InvalidInput(f"{what} must be a dense strided tensor, got {t.layout}"
                           f"{' (quantized)' if t.is_quantized else ''}; nothing was written")
    if t.is_meta:
        raise InvalidInput(f"{what} is a meta tensor: it has no memory to restore into; "
                           "nothing was written (materialize it first, e.g. "
                           "module.to_empty(device='cpu'))")
    if overlaps(t):
        raise InvalidInput(f"{what} has elements that share memory (an expand()ed or "
                           "as_strided view), so a restore cannot write each of them; "
                           "nothing was written (pass a tensor of its own, e.g. .clone())")


def pack_metadata(metadata) -> dict:
    """The user metadata as stored (a msgpack map), checked to round-trip now."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidType(f"metadata must be a mapping, got {type(metadata).__name__}")
    doc = dict(metadata)
    try:
        packed = msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        # msgpack's C packer stops at 512 levels (ValueError); RecursionError is the
        # pure-Python packer's (MSGPACK_PUREPYTHON) answer to the same nesting
        raise InvalidInput(f"metadata is not msgpack-serializable: {exc}") from exc
    try:  # the step node's caps (docs/MANIFEST.md, "Memory caps"), refused before writing
        check_node_size(KIND_STEP, packed, 0)
    except ValueError as exc:
        raise InvalidInput(f"metadata: {exc}") from None
    return doc


def check_touched(touched, tables: Mapping, *, owned: Mapping | None = None
                  ) -> dict[str, torch.Tensor]:
    """Touched row ids per table as 1-D int64 tensors on each table's device, each inside
    the table's rows. ``owned`` (a distributed put's rank): per table, the global row
    ranges ``[(lo, hi), ...]`` this rank holds, which its ids must lie in (on the CPU)."""
    if touched is None:
        return {}
    if not isinstance(touched, Mapping):
        raise InvalidType(f"touched must be a mapping name -> row ids, got {type(touched)}")
    whose = "this put" if owned is None else "this rank's put"
    out = {}
    for name, ids in touched.items():
        if name not in tables:
            raise InvalidInput(f"touched names table {name!r} that is not in {whose}")
        device = tables[name].device if owned is None else "cpu"
        try:
            t = torch.as_tensor(ids, device=device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidType(f"touched[{name!r}] is not a sequence of row ids: {exc}") from exc
        if t.ndim == 1 and t.numel() == 0:
            t = t.to(torch.int64)
        if t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InvalidType(f"touched[{name!r}] must be a 1-D integer sequence of row ids")
        t = t.to(torch.int64)
        if owned is None:
            rows = tables[name].shape[0]
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= rows):
                raise InvalidInput(f"touched[{name!r}] has row ids outside 0..{rows - 1}")
        else:
            inside = torch.zeros(t.shape, dtype=torch.bool)
            for lo, hi in owned[name]:
                inside |= (t >= lo) & (t < hi)
            if not bool(inside.all()):
                raise InvalidInput(f"touched[{name!r}] has row ids outside this rank's rows "
                                   "(touched takes global row ids of the rank's own shards)")
        out[name] = t
    return out


def check_selection(names, rows) -> tuple[list[str] | None, dict]:
    """The ``names`` (None: every table) and ``rows`` (table -> slice) of a read, as a
    list and a dict; the slices themselves are checked against the stored rows later."""
    if names is not None:
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise InvalidType("names must be an iterable of table names (not a str)")
        names = list(names)
    if rows is not None and not isinstance(rows, Mapping):
        raise InvalidType("rows must be a mapping table name -> slice")
    return names, dict(rows or {})


def check_device(device) -> torch.device:
    """A device tables can be restored to, checked before anything is read: torch itself
    reports an unusable one late, as AssertionError ("not compiled with CUDA") or
    RuntimeError, and a meta tensor would hold no data."""
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError) as exc:
        raise InvalidInput(f"bad device {device!r}: {exc}") from exc
    if dev.type == "meta":
        raise InvalidInput("device 'meta' holds no data: restore to a real device")
    try:
        torch.empty(0, device=dev)
    except (AssertionError, RuntimeError, ValueError, TypeError) as exc:
        raise InvalidInput(f"device {str(dev)!r} is not usable here: {exc}") from exc
    return dev

"""cnrstore: incremental, quantized, deduplicated checkpoints of embedding tables.

    import cnrstore
    with cnrstore.open("ckpt/") as store:
        info = store.put_tables(100, {"user": t_user}, quant="int8")
        tables = store.get_tables()        # the latest step
        store.put_state(101, {"model": model.state_dict(), "optim": opt.state_dict()})
        store.load_state(101, {"model": model.state_dict()})   # in place

The user guide is docs/GUIDE.md (API, quantization schemes and their error bounds,
retention and gc, async puts, partial restores); docs/MANIFEST.md and docs/FORMAT.md say
what is stored on disk. ``cnrstore.inspect`` (cnrstore/tools/info.py) lists, shows, diffs
and sizes steps from Python, ``cnrstore.transfer`` exports and imports safetensors; the
``cnrstore`` command (``python -m cnrstore``) does the same from a shell.

Every error cnrstore raises derives from ``cnrstore.CheckpointError`` (the tree is drawn in
cnrstore/errors.py). The store API is imported on first use (PEP 562), so ``import
cnrstore`` and the read-only commands do not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cnrstore.codec.layout import SCHEMES
from cnrstore.core.importing import paused_collector as _paused_collector
from cnrstore.errors import (
    BadPath,
    CheckpointError,
    CollectiveMismatch,
    ConcurrentCommit,
    CorruptData,
    InvalidInput,
    InvalidType,
    ManifestError,
    MissingExtra,
    MissingObject,
    NonFiniteValues,
    NotFound,
    RankFailed,
    ReadOnlyStore,
    StepExists,
    StepNotFound,
    StepOrderError,
    StorageError,
    StoreBusy,
    TableNotFound,
    UnknownScheme,
    ValueOutOfRange,
    WriteFailed,
)

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from cnrstore.core.changes import Change
    from cnrstore.core.maintenance import GCReport, StoreStats, VerifyReport
    from cnrstore.core.options import Options, OptionsMismatch
    from cnrstore.core.store import CheckpointStore
    from cnrstore.core.writer import StepInfo
    from cnrstore.distributed.opener import open
    from cnrstore.distributed.shard import Shard
    from cnrstore.distributed.store import DistributedStore
    from cnrstore.tools.manager import CheckpointManager

__all__ = [
    "SCHEMES",
    "Shard",
    "BadPath",
    "Change",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointStore",
    "CollectiveMismatch",
    "ConcurrentCommit",
    "CorruptData",
    "DistributedStore",
    "GCReport",
    "InvalidInput",
    "InvalidType",
    "ManifestError",
    "MissingExtra",
    "MissingObject",
    "NonFiniteValues",
    "NotFound",
    "RankFailed",
    "ReadOnlyStore",
    "Options",
    "OptionsMismatch",
    "ValueOutOfRange",
    "StepExists",
    "StepInfo",
    "StepNotFound",
    "StepOrderError",
    "StorageError",
    "StoreBusy",
    "StoreStats",
    "TableNotFound",
    "UnknownScheme",
    "VerifyReport",
    "WriteFailed",
    "open",
]

# Public name -> the module that defines it; imported on first access. These modules
# import torch, which costs a second or more: a command that only lists steps never pays it.
_LAZY = {
    "Change": "cnrstore.core.changes",
    "GCReport": "cnrstore.core.maintenance",
    "StoreStats": "cnrstore.core.maintenance",
    "VerifyReport": "cnrstore.core.maintenance",
    "CheckpointStore": "cnrstore.core.store",
    "CheckpointManager": "cnrstore.tools.manager",
    "Options": "cnrstore.core.options",
    "OptionsMismatch": "cnrstore.core.options",
    "open": "cnrstore.distributed.opener",  # dispatches: plain, group= (and later s3://)
    "DistributedStore": "cnrstore.distributed.store",
    "StepInfo": "cnrstore.core.writer",
    "Shard": "cnrstore.distributed.shard",
}

# Modules of the Python tools, as docs/GUIDE.md imports them (``from cnrstore import
# inspect, transfer``); left out of __all__ so that a star import never shadows the
# standard library's inspect.
_TOOLS = {
    "inspect": "cnrstore.tools.info",
    "transfer": "cnrstore.tools.transfer",
}


def _import(module: str) -> Any:
    with _paused_collector():  # cnrstore/core/importing.py
        return importlib.import_module(module)


def __getattr__(name: str) -> Any:
    if name in _TOOLS:
        value: Any = _import(_TOOLS[name])
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cnrstore' has no attribute {name!r}")
    value = getattr(_import(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_TOOLS))

"""cnrstore: incremental, quantized, deduplicated checkpoints of embedding tables.

    import cnrstore
    with cnrstore.open("ckpt/") as store:
        info = store.put_tables(100, {"user": t_user}, quant="int8")
        tables = store.get_tables()        # the latest step
        store.put_state(101, {"model": model.state_dict(), "optim": opt.state_dict()})
        store.load_state(101, {"model": model.state_dict()})   # in place

The user guide is docs/GUIDE.md (API, quantization schemes and their error bounds,
retention and gc, async puts, partial restores); docs/MANIFEST.md and docs/FORMAT.md say
what is stored on disk. ``cnrstore.tools.info`` lists, shows, diffs and sizes steps from
Python; the ``cnrstore`` command (``python -m cnrstore``) does the same from a shell.
"""

from cnrstore.codec.quantize import SCHEMES
from cnrstore.core.maintenance import GCReport, StoreStats, VerifyReport
from cnrstore.core.options import Options, OptionsMismatch
from cnrstore.core.store import CheckpointStore, open
from cnrstore.core.writer import StepInfo
from cnrstore.errors import (
    CheckpointError,
    InvalidInput,
    InvalidType,
    ManifestError,
    NonFiniteValues,
    StepExists,
    StepNotFound,
    StepOrderError,
    TableNotFound,
    UnknownScheme,
    ValueOutOfRange,
    WriteFailed,
)

__all__ = [
    "SCHEMES",
    "CheckpointError",
    "CheckpointStore",
    "GCReport",
    "InvalidInput",
    "InvalidType",
    "ManifestError",
    "NonFiniteValues",
    "Options",
    "OptionsMismatch",
    "ValueOutOfRange",
    "StepExists",
    "StepInfo",
    "StepNotFound",
    "StepOrderError",
    "StoreStats",
    "TableNotFound",
    "UnknownScheme",
    "VerifyReport",
    "WriteFailed",
    "open",
]

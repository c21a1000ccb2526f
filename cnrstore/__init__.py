"""cnrstore: incremental, quantized, deduplicated checkpoints of embedding tables.

    import cnrstore
    with cnrstore.open("ckpt/") as store:
        info = store.put_tables(100, {"user": t_user}, quant="int8")
        tables = store.get_tables()        # the latest step

See DESIGN.md ("Public API") for the contract and docs/MANIFEST.md for what is stored.
"""

from .errors import (
    CheckpointError,
    InvalidInput,
    InvalidType,
    ManifestError,
    NonFiniteValues,
    StepExists,
    StepNotFound,
    TableNotFound,
    UnknownScheme,
    WriteFailed,
)
from .maintenance import GCReport, StoreStats, VerifyReport
from .quantize import SCHEMES
from .store import CheckpointStore, open
from .writer import StepInfo

__all__ = [
    "SCHEMES",
    "CheckpointError",
    "CheckpointStore",
    "GCReport",
    "InvalidInput",
    "InvalidType",
    "ManifestError",
    "NonFiniteValues",
    "StepExists",
    "StepInfo",
    "StepNotFound",
    "StoreStats",
    "TableNotFound",
    "UnknownScheme",
    "VerifyReport",
    "WriteFailed",
    "open",
]

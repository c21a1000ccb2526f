"""The checkpoint layer's exceptions: one tree under ``CheckpointError``.

    CheckpointError              any failure of the checkpoint layer
    ├── InvalidInput (ValueError)        bad arguments; raised before anything is written
    │   ├── InvalidType (TypeError)      a value of the wrong type (e.g. not a tensor)
    │   ├── StepExists                   put of a step the store already holds
    │   ├── StepOrderError               put of a step below the highest (roll back first)
    │   ├── UnknownScheme                a quant scheme cnrstore does not know
    │   ├── NonFiniteValues              NaN/Inf under a lossy scheme (.table, .row)
    │   └── ValueOutOfRange              finite values the scheme cannot hold (.table, .row)
    ├── StepNotFound (KeyError)          a step the store does not hold
    ├── TableNotFound (KeyError)         a table the step does not hold
    ├── ManifestError                    a manifest node or block that cannot be decoded
    └── WriteFailed                      a background put failed (cause in __cause__)

Errors of the storage engine (``engine.StoreError`` and its subclasses: ObjectNotFound,
CorruptObject, StoreLocked, ...) pass through unchanged, so callers catching storage
failures catch one engine base class. A put that fails in the background writer surfaces
on its Future as ``WriteFailed`` chained to the original error.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "InvalidInput",
    "InvalidType",
    "StepExists",
    "StepOrderError",
    "UnknownScheme",
    "NonFiniteValues",
    "ValueOutOfRange",
    "StepNotFound",
    "TableNotFound",
    "ManifestError",
    "WriteFailed",
]


class CheckpointError(Exception):
    """Base class of every error raised by the checkpoint layer."""


class InvalidInput(CheckpointError, ValueError):
    """Bad arguments. Raised before anything is written; the store is left as it was."""


class InvalidType(InvalidInput, TypeError):
    """An argument of the wrong type (a table that is not a tensor, a step that is not
    an int)."""


class StepExists(InvalidInput):
    """A put of a step the store already holds (or is still writing)."""

    def __init__(self, step: int):
        super().__init__(f"step {step} already exists; delete it first to replace it")
        self.step = step


class StepOrderError(InvalidInput):
    """A put of a step lower than the highest step the store holds: "latest" is the
    highest step, so the new step would be hidden. Roll back to an older step first."""

    def __init__(self, step: int, highest: int):
        super().__init__(
            f"step {step} is lower than the store's highest step {highest}; to resume from "
            f"an older step, call rollback(<that step>) first (it deletes the steps after it)"
        )
        self.step = step
        self.highest = highest


class UnknownScheme(InvalidInput):
    """A quantization scheme that is unknown or not allowed for the table's dtype."""


class NonFiniteValues(InvalidInput):
    """A lossy scheme was asked for a table holding NaN or Inf."""

    def __init__(self, table: str, row: int, scheme: str):
        super().__init__(
            f"table {table!r} has NaN/Inf in row {row}; scheme {scheme!r} is lossy and "
            f"cannot encode them (use quant='exact' for this table)"
        )
        self.table = table
        self.row = row
        self.scheme = scheme


class ValueOutOfRange(InvalidInput):
    """A lossy scheme was asked for finite values it cannot hold: beyond +-65504 under
    "fp16", beyond float32's range under "bf16" or intN (whose per-row scale and offset
    widen to fp32 when fp16 cannot hold them, docs/QUANTIZATION.md). Never clamped."""

    def __init__(self, table: str, row: int, scheme: str):
        super().__init__(
            f"table {table!r} row {row} holds finite values beyond what scheme {scheme!r} "
            f"can represent; they would saturate (use 'bf16', an intN scheme or 'exact' "
            f"for this table)" if scheme == "fp16" else
            f"table {table!r} row {row} holds finite values beyond float32's range, which "
            f"scheme {scheme!r} cannot represent (use quant='exact' for this table)"
        )
        self.table = table
        self.row = row
        self.scheme = scheme


class _KeyLike(CheckpointError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class StepNotFound(_KeyLike):
    """The store holds no such step."""

    def __init__(self, step: int, message: str | None = None):
        super().__init__(message or f"step {step} not found")
        self.step = step


class TableNotFound(_KeyLike):
    """The step holds no table of that name."""

    def __init__(self, table: str, step: int):
        super().__init__(f"table {table!r} not found in step {step}")
        self.table = table
        self.step = step


class ManifestError(CheckpointError):
    """A manifest node or block payload is malformed or of an unknown version."""

    def __init__(self, message: str, *, oid: bytes | None = None):
        super().__init__(message)
        self.oid = oid


class WriteFailed(CheckpointError):
    """A put failed in the background writer; ``__cause__`` holds the original error."""

    def __init__(self, step: int, message: str):
        super().__init__(f"put of step {step} failed: {message}")
        self.step = step

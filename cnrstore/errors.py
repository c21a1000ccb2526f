"""The exceptions of cnrstore: one tree under ``CheckpointError``, exit codes on the classes.

    CheckpointError                  any failure of cnrstore (exit 1)
    ├── InvalidInput (ValueError)    bad arguments; raised before anything is written (exit 2)
    │   ├── InvalidType (TypeError)  a value of the wrong type (e.g. not a tensor)
    │   ├── StepExists               put of a step the store already holds
    │   ├── StepOrderError           put of a step below the highest (roll back first)
    │   ├── UnknownScheme            a quant scheme cnrstore does not know
    │   ├── NonFiniteValues          NaN/Inf under a lossy scheme (.table, .row)
    │   ├── ValueOutOfRange          finite values the scheme cannot hold (.table, .row)
    │   ├── ReadOnlyStore            a write on a store opened with readonly=True
    │   ├── BadPath                  a file or store path that is missing, taken, a folder
    │   └── UsageError               bad command-line input (the ``cnrstore`` command)
    ├── NotFound (KeyError)          something the store does not hold (exit 2)
    │   ├── StepNotFound             a step (.step)
    │   └── TableNotFound            a table of a step (.table, .step)
    ├── CorruptData                  stored bytes that fail their checks (.oid, .pack, .offset)
    │   ├── ManifestError            a manifest node or block that cannot be decoded
    │   └── MissingObject            an object a step refers to is not in the store
    ├── StorageError                 the storage engine failed: I/O, format, closed handle
    │   └── StoreBusy                another writer held the store past lock_timeout
    ├── MissingExtra (ImportError)   an optional dependency is not installed (exit 2)
    ├── WriteFailed                  a background put failed (cause in __cause__)
    └── RankFailed                   a rank of a distributed store died or timed out
        └── CollectiveMismatch       the ranks made different store calls (.calls)

Catching ``CheckpointError`` catches all of them: corrupt data, a missing step and bad input
alike. The storage engine keeps its own tree (``engine.StoreError``); its errors are
translated where cnrstore calls it (``translate``, ``engine_errors``), with the engine's
error as ``__cause__`` (``raise ... from exc``), so nothing of the engine's tree escapes the
public API untranslated:

    engine error                     cnrstore error
    CorruptObject, GCRefused         CorruptData
    ObjectNotFound                   MissingObject
    StoreLocked                      StoreBusy
    ConcurrentCommit                 ConcurrentCommit (a StorageError)
    ReadOnly                         ReadOnlyStore
    NoStore (create=False, no store) BadPath
    any other StoreError             StorageError

A put that fails in the background writer surfaces on its Future as ``WriteFailed`` chained
to the original error. ``exit_code`` is what the ``cnrstore`` command exits with for an
error of the class (borg's way): 2 for the caller's mistakes, 1 for problems of the store.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from engine.errors import StoreError

__all__ = [
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "CheckpointError",
    "InvalidInput",
    "InvalidType",
    "StepExists",
    "StepOrderError",
    "UnknownScheme",
    "NonFiniteValues",
    "ValueOutOfRange",
    "ReadOnlyStore",
    "BadPath",
    "UsageError",
    "NotFound",
    "StepNotFound",
    "TableNotFound",
    "CorruptData",
    "ManifestError",
    "MissingObject",
    "StorageError",
    "StoreBusy",
    "ConcurrentCommit",
    "MissingExtra",
    "WriteFailed",
    "RankFailed",
    "CollectiveMismatch",
    "translate",
    "engine_errors",
    "translating",
]

EXIT_OK = 0
EXIT_PROBLEMS = 1  # the store (or a check of it) failed
EXIT_USAGE = 2     # the caller's mistake: bad arguments, a missing store, step or file


class CheckpointError(Exception):
    """Base class of every error cnrstore raises."""

    exit_code: int = EXIT_PROBLEMS

    def __reduce__(self):
        # The subclasses' constructors take their own arguments (a step, a table), which
        # pickle cannot call back with ``args``; rebuilt as they stand instead, so an error
        # crosses a process boundary (DCP gathers every rank's error by pickling it).
        return (_rebuilt, (type(self), self.args, self.__dict__))


def _rebuilt(cls: type[BaseException], args: tuple, attrs: dict) -> BaseException:
    exc = cls.__new__(cls)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(attrs)
    return exc


class InvalidInput(CheckpointError, ValueError):
    """Bad arguments. Raised before anything is written; the store is left as it was."""

    exit_code = EXIT_USAGE


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


class ReadOnlyStore(InvalidInput):
    """A write (put, delete, rollback, gc) on a store opened with ``readonly=True``."""


class BadPath(InvalidInput):
    """A path that cannot be used as asked: no store or file there, a file that exists and
    may not be overwritten, a folder where a file is wanted. Nothing was created."""

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class UsageError(InvalidInput):
    """Bad input from the command line that argparse cannot see (a missing store, a
    malformed ``--quant``)."""


class NotFound(CheckpointError, KeyError):
    """Something the store does not hold: a step, or a table of a step."""

    exit_code = EXIT_USAGE

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StepNotFound(NotFound):
    """The store holds no such step."""

    def __init__(self, step: int, message: str | None = None):
        super().__init__(message or f"step {step} not found")
        self.step = step


class TableNotFound(NotFound):
    """The step holds no table of that name."""

    def __init__(self, table: str, step: int):
        super().__init__(f"table {table!r} not found in step {step}")
        self.table = table
        self.step = step


class CorruptData(CheckpointError):
    """Stored bytes that fail their checks: a checksum or id mismatch, a node or block that
    cannot be decoded, an object a step refers to that is gone. ``cnrstore verify`` lists
    what is damaged; ``oid``, ``pack`` and ``offset`` say where, when known."""

    def __init__(self, message: str, *, oid: bytes | None = None, pack: str | None = None,
                 offset: int | None = None):
        super().__init__(message)
        self.oid = oid
        self.pack = pack
        self.offset = offset


class ManifestError(CorruptData):
    """A manifest node or block payload is malformed or of an unknown version."""


class MissingObject(CorruptData):
    """An object that a step (or a patch chain) refers to is not in the store."""


class StorageError(CheckpointError):
    """The storage engine failed for a reason other than damaged data: I/O, an unknown
    format version, an index that cannot be brought up to date, a closed handle.
    ``__cause__`` holds the engine's error."""


class StoreBusy(StorageError):
    """Another writer (this or another process) held the store past ``lock_timeout``."""


class ConcurrentCommit(StorageError):
    """Another writer, on another cache of the same bucket, committed first; nothing of
    this put or gc was published. Retry it (a put of a step the winner wrote is
    StepExists instead)."""


class MissingExtra(CheckpointError, ImportError):
    """An optional dependency is not installed (``pip install 'cnrstore[...]'``)."""

    exit_code = EXIT_USAGE


class WriteFailed(CheckpointError):
    """A put failed in the background writer; ``__cause__`` holds the original error."""

    def __init__(self, step: int, message: str):
        super().__init__(f"put of step {step} failed: {message}")
        self.step = step


class RankFailed(CheckpointError):
    """A collective operation of a distributed store (cnrstore/distributed/) failed because a rank
    died, hung past the store's ``timeout`` or lost its connection: nothing of the
    operation became visible (unless the coordinator's commit already had, which
    ``steps()`` of a reopened store tells). The handle's process group is then broken:
    close it and open the store again (the job restarts, as after any rank failure).
    ``rank`` is the group rank that failed, when known."""

    def __init__(self, message: str, *, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class CollectiveMismatch(RankFailed):
    """The ranks of a distributed store are not in the same call: every method is
    collective, and a rank called another one (or skipped one). Detected at the first
    round where they differ, on every rank; ``calls`` lists, per rank, the round it was
    in as (what, round number of the handle). The handle is then unusable, as after
    RankFailed: close it and open the store again."""

    def __init__(self, message: str, *, calls: list[tuple[str, int]] | None = None):
        super().__init__(message)
        self.calls = calls


# -- the boundary with the storage engine ---------------------------------------------------

def translate(exc: StoreError) -> CheckpointError:
    """The cnrstore error that stands for the engine error ``exc`` (see the table in the
    module docstring). The caller raises it ``from exc``; ids, packs and offsets carry over."""
    from engine import errors as e

    message = str(exc)
    if isinstance(exc, e.CorruptObject):
        return CorruptData(message, oid=exc.oid, pack=exc.pack, offset=exc.offset)
    if isinstance(exc, e.ObjectNotFound):
        return MissingObject(message, oid=exc.oid)
    if isinstance(exc, e.StoreLocked):
        return StoreBusy(message)
    if isinstance(exc, e.ReadOnly):
        return ReadOnlyStore(message)
    if isinstance(exc, e.CommitSequenceTaken):
        return ConcurrentCommit(message)
    if isinstance(exc, e.NoStore):
        return BadPath(message)
    return StorageError(message)


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """Translate the engine errors raised in the block (``raise translate(exc) from exc``).
    cnrstore's own errors and everything else pass through unchanged."""
    from engine.errors import StoreError

    try:
        yield
    except StoreError as exc:
        raise translate(exc) from exc


_F = TypeVar("_F", bound=Callable[..., Any])


def translating(fn: _F) -> _F:
    """Decorator form of ``engine_errors`` for the public methods of the store."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with engine_errors():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]

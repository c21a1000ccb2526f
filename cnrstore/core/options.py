"""Options of a store handle, validated once when the handle is created."""

from __future__ import annotations

from dataclasses import dataclass

from cnrstore.errors import InvalidInput

__all__ = ["Options", "positive"]


@dataclass(frozen=True)
class Options:
    block_rows: int
    fanout: int
    max_chain: int
    max_inflight: int
    decode_threads: int
    expected_restores: int
    seed_from_store: bool
    lock_timeout: float | None


def positive(name: str, value, *, lo: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise InvalidInput(f"{name} must be an int >= {lo}, got {value!r}")
    return value

"""The engine's options, and the rule for the copy kept in the index (``meta.options``).

Two kinds (docs/design/store-engine.md, "Engine options"):

- data options describe bytes already stored: a store opened with another value would
  misread them. They are fixed when the store is created; an open that asks for another
  value fails with EngineOptionsMismatch. The engine has none today: every record says how it
  is compressed and every pack how long it is, so nothing about stored bytes depends on
  an option (a change to the record or pack layout is a format_version change instead).
- tuning options only shape what is written or mapped from now on (``compression_level``
  of new records, ``pack_target_size`` of new packs, ``map_size`` of the LMDB map). They
  may differ between opens; an open that does not pass one takes the value the store was
  created with (read back from the index), else the engine default.

The index is derived data (repair rebuilds it from the packs), so whatever it keeps here is
a convenience: a rebuilt index records the options of the handle that rebuilt it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import EngineOptionsMismatch

DEFAULTS: dict[str, int] = {
    "compression_level": 3,
    "pack_target_size": 256 << 20,
    "map_size": 1 << 30,
}
_RANGES: dict[str, tuple[int, int]] = {
    "compression_level": (-7, 22),
    "pack_target_size": (1 << 10, 1 << 40),
    "map_size": (1 << 16, 1 << 50),
}
# Names of options that describe stored data (see above): none in this engine.
DATA_OPTIONS: frozenset[str] = frozenset()
# The options kept in ``meta.options`` (map_size is not: LMDB keeps the map's size itself).
PERSISTED = ("compression_level", "pack_target_size")


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, got {value!r}")
    return value


@dataclass(frozen=True)
class EngineOptions:
    compression_level: int = DEFAULTS["compression_level"]
    pack_target_size: int = DEFAULTS["pack_target_size"]
    map_size: int = DEFAULTS["map_size"]

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f.name, getattr(self, f.name), *_RANGES[f.name])

    def to_wire(self) -> dict[str, int]:
        """A plain dict (picklable, msgpack-able), for a coordinator to send to ranks."""
        return asdict(self)

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> EngineOptions:
        """Inverse of ``to_wire``; unknown keys (a newer engine's) are ignored, missing
        ones take the defaults; ValueError for values out of range."""
        if not isinstance(wire, Mapping):
            raise ValueError(f"engine options must be a mapping, got {type(wire).__name__}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in wire.items() if k in names})

    def persisted(self) -> dict[str, int]:
        """The map written to ``meta.options``."""
        return {k: v for k, v in asdict(self).items() if k in PERSISTED}


def resolve(asked: Mapping[str, int | None], stored: Mapping[Any, Any] | None, *,
            data_options: frozenset[str] = DATA_OPTIONS) -> EngineOptions:
    """The options of an open that asked for ``asked`` (None: not given) of a store whose
    index holds ``stored`` (None: a new store, or an index without the map).

    A data option asked for with another value than the stored one raises EngineOptionsMismatch;
    a tuning option not asked for takes the stored value when it is valid. Stored keys this
    engine does not know are left alone: a newer engine's tuning, since anything that
    changes how stored bytes are read changes format_version."""
    stored = dict(stored) if isinstance(stored, Mapping) else {}
    values: dict[str, int] = {}
    for name, default in DEFAULTS.items():
        value = asked.get(name)
        old = stored.get(name)
        if name in data_options and value is not None and old is not None and old != value:
            raise EngineOptionsMismatch(
                f"option {name}={value!r} conflicts with the store's {name}={old!r}, which "
                "describes data already stored; open it without the option or with the "
                "stored value", name=name, stored=old, asked=value)
        if value is None:
            lo, hi = _RANGES[name]
            valid = isinstance(old, int) and not isinstance(old, bool) and lo <= old <= hi
            value = old if valid else default
        values[name] = int(value) if value is not None else default
    return EngineOptions(**values)

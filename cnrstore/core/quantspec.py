"""The ``quant`` argument of a put: a scheme per table from a scheme name or a mapping of
fnmatch patterns (docs/GUIDE.md, "Training state and lineage": "A quant pattern that matches
nothing is an error").

Rules, in order:

- ``quant="int8"`` (a string) means ``{"*": "int8"}``.
- In a mapping, a key without wildcards (``*?[``) names one table and wins over every
  pattern (so ``{"*": "int8", "ids": "exact"}`` keeps ``ids`` exact, as before patterns).
  Otherwise the first pattern, in mapping order, that matches the name wins; a table no
  key matches is stored exactly.
- Tensors with fewer than 2 dimensions (biases, counters, 0-dim steps, RNG states) are
  always stored exactly: a lossy scheme saves nothing there and they are the values a
  training job least tolerates errors in. A wildcard pattern also skips integer tensors;
  a lossy scheme named for an integer table (by its name, or by ``quant="int8"``) is
  refused, as before patterns.
- Typo safety: a key that matches no table of the put, or a lossy key that matches only
  tensors it cannot quantize, is an error (InvalidInput) before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

import torch

from cnrstore.codec.autopolicy import auto_scheme
from cnrstore.codec.quantize import SCHEMES, check_scheme
from cnrstore.errors import InvalidInput, InvalidType, UnknownScheme

__all__ = ["resolve_quant", "is_pattern"]

_LOSSY_OK = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def is_pattern(key: str) -> bool:
    return any(c in key for c in "*?[")


def _spec(quant) -> tuple[list[tuple[str, object]], bool]:
    if isinstance(quant, str):
        return [("*", quant)], False
    if not isinstance(quant, Mapping):
        raise InvalidType(f"quant must be a scheme name or a mapping, got {type(quant).__name__}")
    for key in quant:
        if not isinstance(key, str) or not key:
            raise InvalidType(f"quant keys must be table names or patterns, got {key!r}")
    return list(quant.items()), True


def resolve_quant(quant, tables: Mapping, *, expected_restores: int) -> dict[str, str]:
    """Scheme per table name of ``tables`` (name -> tensor) from ``quant``."""
    spec, explicit = _spec(quant)
    exact_keys = {k: v for k, v in spec if not is_pattern(k)}
    patterns = [(k, v) for k, v in spec if is_pattern(k)]
    if explicit:
        unknown = sorted(k for k in exact_keys if k not in tables)
        unmatched = sorted(k for k, _ in patterns
                           if not any(fnmatchcase(n, k) for n in tables))
        if unknown or unmatched:
            raise InvalidInput(
                f"quant names tables that are not in this put: {unknown + unmatched} "
                f"(tables: {sorted(tables)[:20]})"
            )
    chosen: dict[str, tuple[str | None, object]] = {}
    for name in tables:
        if name in exact_keys:
            chosen[name] = (name, exact_keys[name])
            continue
        for key, scheme in patterns:
            if fnmatchcase(name, key):
                chosen[name] = (key, scheme)
                break
    # A lossy key whose every table has ndim < 2 asked for something that cannot happen.
    effective: dict[str, bool] = {}
    out = {}
    for name, table in tables.items():
        ckey, scheme = chosen.get(name, (None, "exact"))
        if not isinstance(scheme, str) or (scheme not in SCHEMES and scheme != "auto"):
            raise UnknownScheme(
                f"unknown quant scheme {scheme!r} for table {name!r}; known: "
                f"{', '.join(SCHEMES)} or 'auto'"
            )
        small = table.ndim < 2
        eligible = not small and table.dtype in _LOSSY_OK
        if ckey is not None:
            effective[ckey] = effective.get(ckey, False) or eligible or scheme in ("exact", "auto")
        if scheme == "auto":
            scheme = auto_scheme(expected_restores) if table.dtype in _LOSSY_OK else "exact"
        if ckey is not None and explicit and is_pattern(ckey) and not eligible:
            scheme = "exact"  # a wildcard skips int tensors (e.g. BatchNorm's counters)
        # a lossy scheme named for an integer table is refused (docs/GUIDE.md, "The API contract")
        try:
            check_scheme(scheme, table.dtype, table=name)
        except ValueError as exc:
            raise UnknownScheme(str(exc)) from exc
        if small:
            scheme = "exact"
        out[name] = scheme
    if explicit:
        useless = sorted(k for k, ok in effective.items() if not ok)
        if useless:
            raise InvalidInput(
                f"quant keys {useless} match only tensors with fewer than 2 dimensions "
                "or of integer dtype, which are always stored exactly"
            )
    return out

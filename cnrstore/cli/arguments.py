"""The arguments of the ``cnrstore`` command that more than one subcommand shares: the
common flags (``--json``, ``--debug``, ...), what a STEP, a count or a ``--quant`` value may
be, and how ``latest`` becomes a step.

They are apart from cnrstore/cli/app.py, which builds the subcommands from them and
dispatches, so that each module stays one concept. Like app.py at start-up, this module
imports no more than argparse, locate and the error classes; ``resolve_step`` reads the index
only when called.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from cnrstore.cli.locate import CACHE_ENV
from cnrstore.errors import UsageError

if TYPE_CHECKING:
    from engine import ObjectStore

__all__ = ["LATEST", "common_flags", "parse_count", "parse_quant", "parse_step",
           "parse_step_or_latest", "resolve_step"]


def common_flags(*, suppress: bool) -> argparse.ArgumentParser:
    # The same flags work before and after the subcommand. In subparsers the defaults are
    # SUPPRESS, so a subparser does not overwrite a flag given before the subcommand.
    default = argparse.SUPPRESS if suppress else False
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", default=default,
                   help="print one JSON document instead of tables")
    p.add_argument("--debug", action="store_true", default=default,
                   help="show tracebacks instead of one-line errors")
    p.add_argument("--no-progress", action="store_true", default=default,
                   help="no progress bars (they only appear on a terminal anyway)")
    p.add_argument("--cache-dir", metavar="DIR",
                   default=argparse.SUPPRESS if suppress else None,
                   help="local directory of the index cache of a store on S3 "
                        f"(s3://bucket/prefix) or on a shared directory; default ${CACHE_ENV}")
    return p


LATEST = "latest"  # a STEP argument naming the store's highest step


def parse_step(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a step is a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, got {text!r}")
    return value


def parse_step_or_latest(text: str) -> int | str:
    if text == LATEST:
        return LATEST
    try:
        return parse_step(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"a step is a non-negative integer or {LATEST}, got {text!r}") from None


def parse_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def resolve_step(objects: ObjectStore, step: int | str) -> int:
    """A STEP argument as a step: ``latest`` is the store's highest step."""
    if step != LATEST:
        return int(step)
    from cnrstore.errors import NotFound
    from cnrstore.format.load import list_steps

    steps = list_steps(objects)
    if not steps:
        raise NotFound("the store holds no steps, so there is no latest step")
    return steps[-1]


def parse_quant(items: list[str] | None) -> str | dict | None:
    """``--quant`` values as import_step takes them: None, one scheme, or a mapping."""
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        name, sep, scheme = item.rpartition("=")
        key = name if sep else "*float"
        if not scheme or (sep and not name) or key in out:
            raise UsageError(f"--quant {item!r}: expected SCHEME or NAME=SCHEME, once each")
        out[key] = scheme
    return out["*float"] if list(out) == ["*float"] else out

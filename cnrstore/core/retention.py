"""The retention rule of gc: which steps a ``gc(keep_last=..., keep=...)`` keeps.

One rule for every caller (the API's gc, the CLI's gc and its dry run), so the two cannot
drift apart again: the API once accepted ``keep_last=0`` and a ``keep`` naming a missing
step, and deleted every step, while the CLI refused both (docs/GUIDE.md, "The API contract", gc).
"""

from __future__ import annotations

from collections.abc import Iterable

from cnrstore.errors import InvalidInput, InvalidType

__all__ = ["check_retention", "kept_steps"]


def check_retention(keep_last, keep) -> tuple[int | None, set[int]]:
    """The arguments checked on their own (before the store is looked at): ``keep_last``
    None or an int >= 1, ``keep`` an iterable of ints >= 0. Raises InvalidInput."""
    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
    ):
        raise InvalidInput(
            f"keep_last must be None or an int >= 1, got {keep_last!r} (to drop every "
            "step, delete the steps by name)"
        )
    if isinstance(keep, (str, bytes)) or not isinstance(keep, Iterable):
        raise InvalidType("keep must be an iterable of steps")
    steps = set()
    for s in keep:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise InvalidInput(f"keep must hold steps (ints >= 0), got {s!r}")
        steps.add(s)
    return keep_last, steps


def kept_steps(have: Iterable[int], *, keep_last: int | None, keep: Iterable[int] = ()
               ) -> list[int]:
    """The steps gc keeps out of ``have``: the newest ``keep_last`` plus ``keep``; all of
    them when neither is given. A ``keep`` naming a step the store lacks is refused
    (InvalidInput), so a typo cannot silently drop the step that was meant."""
    keep_last, keep = check_retention(keep_last, keep)
    have = sorted(have)
    missing = sorted(keep - set(have))
    if missing:
        raise InvalidInput(
            f"cannot keep step {missing[0]}: the store holds no such step; nothing was dropped"
        )
    if keep_last is None and not keep:
        return have
    newest = set(have[-keep_last:]) if keep_last else set()
    return sorted(newest | keep)

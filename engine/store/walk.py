"""The one walk of the object DAG: gc's mark, verify, repair's completeness check and the
in-memory twin all go through ``walk``; they differ only in where an object's refs come
from and in what a missing or unverifiable object means to them (gc refuses to sweep,
verify reports a problem, repair rejects a root), which ``refs_of`` decides."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

# How an object was reached: the name of the root it starts from (str), or the id of the
# object whose ref it is (bytes).
Via = str | bytes
RefsOf = Callable[[bytes, Via], Sequence[bytes] | None]


def walk(starts: Iterable[tuple[bytes, str]], refs_of: RefsOf) -> set[bytes]:
    """Every object reachable from ``starts`` ((id, root name) pairs) that ``refs_of``
    found; each id is asked for once. ``refs_of(oid, via)`` returns the object's refs, or
    None when it is missing or cannot be trusted, after reporting that its own way (it
    may raise to stop the walk). Iterative, so a deep chain cannot hit the recursion
    limit."""
    seen: set[bytes] = set()
    missing: set[bytes] = set()
    # Groups of sibling refs with the object they are refs of: one stack entry per object
    # rather than one tuple per ref (gc marks whole stores through here).
    stack: list[tuple[Sequence[bytes], Via]] = [((oid,), name) for oid, name in starts]
    while stack:
        oids, via = stack.pop()
        for oid in oids:
            if oid in seen:
                continue
            seen.add(oid)
            refs = refs_of(oid, via)
            if refs is None:
                missing.add(oid)
            elif refs:
                stack.append((refs, oid))
    return seen - missing if missing else seen


def describe(via: Via) -> str:
    """``via`` as the messages of problems say it."""
    return f"root {via!r}" if isinstance(via, str) else f"object {via.hex()}"

"""Reading the commit chain of a bucket or shared-directory store (docs/FORMAT.md "Object
stores"): which keys are commits, fetching their documents with bounded memory, and a
survey of the whole chain that gc and a rebuild use to tell what it still proves.

Only keys exactly ``commits/<20 digits>`` are commits (commitdoc.seq_of_key). The chain
is dense: a number missing below the newest is damage, as is a document too big to be
one, unreadable or failing its checks.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ...api import Problem
from ...errors import CorruptObject
from ...format.commitdoc import (
    COMMITS,
    MAX_COMMIT_BYTES,
    CommitDoc,
    commit_key,
    decode_commit,
    seq_of_key,
)

_IN_FLIGHT = 16  # documents fetched at once (an empty cache of a long-lived store reads
# thousands), never more than MAX_COMMIT_BYTES of them


class ChainDamaged(CorruptObject):
    """A commit document is missing, too big or damaged (``key`` names it)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message, pack=key)
        self.key = key


def listed(storage: Any, after: int = 0) -> list[tuple[int, str, int]]:
    """(seq, key, size) of every commit after ``after``, in order."""
    out = []
    for key, size, _, _ in storage.list(COMMITS, after=commit_key(after)):
        seq = seq_of_key(key)
        if seq is not None and seq > after:
            out.append((seq, key, int(size)))
    out.sort()
    return out


def _fetched(storage: Any, items: list[tuple[int, str, int]]
             ) -> Iterator[tuple[int, str, CommitDoc | ChainDamaged]]:
    """Each item's document (or what is wrong with it), in order."""

    def fetch(item: tuple[int, str, int]) -> CommitDoc | ChainDamaged:
        seq, key, size = item
        if size > MAX_COMMIT_BYTES:
            return ChainDamaged(f"commit document {key} is damaged: listed at {size} bytes, "
                                f"more than the {MAX_COMMIT_BYTES} a document may have "
                                "(not read)", key=key)
        try:
            return decode_commit(storage.get(key, limit=MAX_COMMIT_BYTES), key)
        except FileNotFoundError:
            return ChainDamaged(f"commit document {key} vanished while it was read", key=key)
        except CorruptObject as exc:
            return ChainDamaged(str(exc), key=key)

    if len(items) <= 1:
        for seq, key, size in items:
            yield seq, key, fetch((seq, key, size))
        return
    # A sliding window: at most _IN_FLIGHT documents and MAX_COMMIT_BYTES of them (by
    # their listed sizes) in flight or done but not yet handed on, in order.
    window: collections.deque = collections.deque()
    budget = 0
    with concurrent.futures.ThreadPoolExecutor(_IN_FLIGHT) as pool:
        for item in items:
            while window and (len(window) >= _IN_FLIGHT
                              or budget + item[2] > MAX_COMMIT_BYTES):
                (seq, key, size), future = window.popleft()
                budget -= size
                yield seq, key, future.result()
            window.append((item, pool.submit(fetch, item)))
            budget += item[2]
        while window:
            (seq, key, _), future = window.popleft()
            yield seq, key, future.result()


def _gaps(items: list[tuple[int, str, int]], after: int
          ) -> Iterator[tuple[int, tuple[int, str, int] | None]]:
    """(expected seq, the item there or None when that number is missing)."""
    expect = after + 1
    for item in items:
        while expect < item[0]:
            yield expect, None
            expect += 1
        yield expect, item
        expect += 1


def documents(storage: Any, after: int) -> Iterator[CommitDoc]:
    """Every commit document after ``after``, in order and validated; ChainDamaged at the
    first that is missing, too big or damaged (nothing after it is read)."""
    items = listed(storage, after)
    for expect, item in _gaps(items, after):
        if item is None:
            nxt = next(i[0] for i in items if i[0] > expect)
            raise ChainDamaged(f"{storage.describe()}: commit document "
                               f"{commit_key(expect)} is missing (the next is {nxt}): the "
                               "commit chain is broken",
                               key=commit_key(expect))
    for _, _, doc in _fetched(storage, items):
        if isinstance(doc, ChainDamaged):
            raise doc
        yield doc


@dataclass
class Survey:
    """What the whole chain says, read to its end past any damage."""

    newest: int = 0                       # the highest commit number listed
    problems: list[Problem] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)    # retired by a readable document
    packs: set[int] = field(default_factory=set)   # listed by one and not retired since


def survey(storage: Any, upto: int | None = None) -> Survey:
    """Read every commit document, or those up to commit ``upto`` (bounded memory: only
    pack numbers are kept)."""
    items = [i for i in listed(storage, 0) if upto is None or i[0] <= upto]
    out = Survey(newest=items[-1][0] if items else 0)
    for expect, item in _gaps(items, 0):
        if item is None:
            out.problems.append(Problem(
                "missing-commit", f"{storage.describe()}: commit document "
                f"{commit_key(expect)} is missing: the commit chain is broken",
                pack=commit_key(expect)))
    for _, key, doc in _fetched(storage, items):
        if isinstance(doc, ChainDamaged):
            out.problems.append(Problem("damaged-commit", str(doc), pack=key))
            continue
        gone = set(doc.gone)
        out.gone |= gone
        out.packs = (out.packs - gone) | {p.number for p in doc.packs}
    return out

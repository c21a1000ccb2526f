"""Deleting the packs the index no longer lists (gc's last step, docs/FORMAT.md "Garbage
collection" step 4): compacted packs and crash leftovers. One routine for every commit
log; a bucket's holds packs back for its grace period and its proofs (``keep``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..format.names import pack_name
from ..fs.fileio import store_error
from ..index import db as ix

if TYPE_CHECKING:
    from .core import PackStoreState


def listed_packs(txn: ix.Txn, index: ix.Index) -> set[int]:
    return {ix.unpack_pack_key(k) for k in txn.cursor(db=index.packs).iternext(values=False)}


def delete_unlisted(core: PackStoreState, live_packs: set[int], present: Iterable[int], *,
                    listed: set[int] | None = None,
                    keep: Callable[[int], bool] = lambda n: False) -> list[int]:
    """Delete each pack of ``present`` that the index does not list (``listed``, read now
    when not given), that no live object lives in (``live_packs``: even if the packs table
    lost it, damage) and that ``keep`` does not hold back; the numbers deleted. Safe only
    under the writer lock, when no writer has unpublished packs."""
    if listed is None:
        index = core.index
        listed = index.read(lambda t: listed_packs(t, index))
    deleted = []
    for n in sorted(present):
        if n in listed or n in live_packs or keep(n):
            continue
        core.readers.forget(n)
        try:
            if core.storage.delete(n):
                deleted.append(n)
        except OSError as exc:
            raise store_error(f"cannot delete pack {pack_name(n)}", exc) from exc
    return deleted

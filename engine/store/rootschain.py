"""Does the roots chain the index names replay to the index's roots? (docs/FORMAT.md
"Garbage collection", step 3).

gc keeps the roots records of the packs ``meta.roots_chain`` names and lets the others go
with the packs it rewrites or drops: the chain (the newest full snapshot and the deltas
after it) is what a repair replays to find the roots. That value has no checksum, since
every commit moves it, and a flipped bit in it once named a pack that does not exist: a
gc then merged away every roots record, and the repair after it found none and dropped
every root. So gc reads the chain's records first and trusts the chain only when they
replay, without a gap, to the index's roots (which pass their own checksum); otherwise
it writes a fresh full snapshot of those roots, as it does when a chain pack is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import CorruptObject
from ..format import records as fmt
from ..packs.pack import pack_name
from .repairroots import Snapshot, in_order

if TYPE_CHECKING:
    from .core import PackStoreState


def chain_records(store: PackStoreState, chain: set[int]) -> list[Snapshot] | None:
    """The roots records of the packs in ``chain``, None when one cannot be read."""
    found: list[Snapshot] = []
    for n in sorted(chain):
        name = pack_name(n)
        try:
            for t in store.storage.read_trailer(n):
                if t.rtype not in fmt.ROOTS_RECORDS:
                    continue
                rec = fmt.decode_record(store.storage.read(n, t.offset, t.length), 0,
                                        pack=name)
                roots = fmt.decode_roots_record(rec.payload, rec.header.rtype, pack=name,
                                                offset=t.offset)
                found.append((roots.seq, n, t.offset, roots, len(rec.payload)))
        except (CorruptObject, OSError):
            return None
    return found


def chain_holds(store: PackStoreState, chain: set[int], roots: dict[str, bytes]) -> bool:
    """Whether the records of ``chain`` are a full snapshot and the deltas after it, with
    no sequence missing, that replay to exactly ``roots``."""
    records = chain_records(store, chain)
    if not records:
        return False
    ordered = in_order(records)
    start = max((i for i, s in enumerate(ordered) if s[3].full), default=None)
    if start is None:
        return False
    state: dict[str, bytes] = {}
    for i, (seq, _, _, rec, _) in enumerate(ordered[start:], start):
        if i > start and seq != ordered[i - 1][0] + 1:
            return False
        state = rec.apply(state)
    return state == roots

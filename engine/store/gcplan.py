"""gc's plan: which packs a collection drops, and which it rewrites for their dead bytes
or to merge small packs (docs/FORMAT.md "Garbage collection", step 3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..index import db as ix

if TYPE_CHECKING:
    from .core import PackStoreState


# A pack smaller than pack_target_size / SMALL_PACK_DIVISOR is small: gc merges the small
# packs of one kind (data, meta) when there are at least two (docs/FORMAT.md "Garbage
# collection"). The records of small packs are under the limit, so every pack a merge of
# them writes but the last of its kind holds more than target - limit > limit: gcs with no
# new commits settle (at most one small pack per kind, nothing left to merge).
SMALL_PACK_DIVISOR = 16


@dataclass
class Plan:
    rewrite: list[int] = field(default_factory=list)  # packs whose live records move
    drop: list[int] = field(default_factory=list)     # packs with nothing live
    meta: dict[int, bool] = field(default_factory=dict)
    next_pack: int = 0
    seq: int = 0
    snapshot_pack: int = -1
    chain: set[int] = field(default_factory=set)  # packs holding the current roots chain
    chain_bytes: tuple[int, int] = (0, 0)  # its delta and full snapshot payload bytes
    chain_only: set[int] = field(default_factory=set)  # of those, packs holding nothing else
    roots: dict[str, bytes] = field(default_factory=dict)


def plan_packs(store: PackStoreState, threshold: float, live_packs: set[int],
               held: set[int]) -> Plan:
    """Which packs to drop or rewrite. A pack that a live object lives in is never
    dropped, whatever its (unchecksummed) counters say: at worst it is rewritten (and a
    size that lies only makes a pack merged or not: rewriting is always safe)."""
    index = store.index
    small_limit = store.options.pack_target_size // SMALL_PACK_DIVISOR

    def read(txn: ix.Txn) -> Plan:
        plan = Plan()
        plan.next_pack = ix.get_next_pack(txn, index.meta)
        plan.seq = ix.get_u64(txn, index.meta, ix.META_SEQ)
        plan.snapshot_pack = ix.get_snapshot_pack(txn, index.meta)
        packs, delta_bytes, full_bytes = ix.get_chain(txn, index.meta)
        plan.chain, plan.chain_bytes = set(packs), (delta_bytes, full_bytes)
        plan.roots = {k.decode(): bytes(v) for k, v in txn.cursor(db=index.roots)}
        small: dict[bool, list[int]] = {False: [], True: []}
        for key, raw in txn.cursor(db=index.packs):
            n, p = ix.unpack_pack_key(key), ix.PackEntry.decode(raw)
            plan.meta[n] = p.meta
            if n in held:
                continue  # a live lease's pack: gc leaves it alone
            if p.count == 0 and n in live_packs:
                plan.rewrite.append(n)
            elif p.count == 0:
                # Nothing live; a snapshot-only pack of the current roots chain stays,
                # or every gc would replace it with an identical snapshot.
                if p.total > 0 or n not in plan.chain:
                    plan.drop.append(n)
                else:
                    plan.chain_only.add(n)
                    if p.size < small_limit:
                        small[p.meta].append(n)
            elif p.dead_fraction > threshold:
                plan.rewrite.append(n)
            elif p.size < small_limit:
                small[p.meta].append(n)
        for meta, packs in small.items():
            # One small pack alone would only be copied to another, unless packs of its
            # kind are being rewritten anyway (it joins their new pack).
            if len(packs) >= 2 or any(plan.meta[n] == meta for n in plan.rewrite):
                plan.rewrite.extend(packs)
        plan.rewrite.sort()
        return plan

    return index.read(read)

"""Read-ahead of a DCP load's first blocks, started when the rank's plan is known
(docs/design/dcp-speed.md, "The first blocks hinted at the plan").

Between ``read_metadata`` and the first block read of ``read_data`` a cold load spends
~30 ms with the disk idle: DCP's planning collectives, the kept store's reuse check and
the read's request and answer rounds. The metadata read brings, with the step's
document, where every block's records are (the coordinator's ``locate_closure`` of the
step's blocks: a few KB); ``prepare_local_plan`` (the first point a rank knows the rows
it reads) hints the patch records of its blocks (all at once: they are small and the
read takes each window's patches first), then the first ``EARLY_BYTES`` of its blocks,
in the order the read takes them, on a thread of its own. Hints only: the read locates
every record again through the request round and checks what it reads; a stale or
failed hint costs nothing but the hint.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import engine
from cnrstore.codec.cores import start_thread
from cnrstore.format.load import load_step, load_table_manifest

__all__ = ["EARLY_BYTES", "Locations", "even_split", "hint", "locations", "patches", "plan"]

EARLY_BYTES = 32 << 20  # hinted at the plan: about the disk's reads until read_data reads

# {fqn: (block_rows, [[wire location of each record of the block's chain]])}
Locations = dict[str, tuple[int, list[list[tuple]]]]


def locations(objects: Any, step: int, names: Iterable[str]) -> Locations | None:
    """Where the records of ``step``'s tables ``names`` lie, per block (on the coordinator,
    or the one process); None where the store does not locate records or anything fails
    (then nothing is hinted)."""
    if not isinstance(objects, engine.PackStore):
        return None
    try:
        _, node = load_step(objects, step)
        by_name = dict(zip(node.tables, node.table_ids))
        tables = {n: load_table_manifest(objects, by_name[n]) for n in names if n in by_name}
        found = objects.locate_closure([b for tm in tables.values() for b in tm.block_ids])
        out: Locations = {}
        for n, tm in tables.items():
            chains = []
            for oid in tm.block_ids:
                chain, todo, seen = [], [oid], set()
                while todo:
                    o = todo.pop()
                    loc = found.get(o)
                    if loc is None or o in seen:
                        continue
                    seen.add(o)
                    chain.append(loc.to_wire())
                    todo.extend(loc.refs)
                chains.append(chain)
            out[n] = (tm.node.block_rows, chains)
        return out
    except Exception:  # noqa: BLE001 - hints only: the read itself reports any damage
        return None


def plan(locs: Locations, spans: list[tuple[str, int, int]],
         budget: int = EARLY_BYTES) -> list[list[tuple]]:
    """The chains (wire locations) of the blocks overlapping each (fqn, lo, hi) row span,
    in this order, each block once, until ``budget`` stored bytes."""
    chains: list[list[tuple]] = []
    seen: set[tuple[str, int]] = set()
    total = 0
    for fqn, lo, hi in spans:
        if fqn not in locs or hi <= lo:
            continue
        block_rows, per_block = locs[fqn]
        for b in range(lo // block_rows, min(len(per_block), -(-hi // block_rows))):
            if total >= budget:
                return chains
            if (fqn, b) not in seen:
                seen.add((fqn, b))
                chains.append(per_block[b])
                total += sum(engine.RecordLocation.from_wire(w).length for w in per_block[b])
    return chains


def even_split(locs: Locations, world: int, budget: int = EARLY_BYTES) -> list[list[tuple]]:
    """``plan``'s chains of the first ``budget`` bytes of each of ``world`` ranks, were each
    to read an even share of every table's rows (DCP's cut of a row-sharded tensor at
    ``world`` ranks), taken a block of each rank in turn: what the coordinator hints as it
    opens, before any rank knows its plan. A guess: a rank that reads other rows hints
    its own at its plan, as without it."""
    per_rank = []
    for r in range(world):
        spans = []
        for fqn, (block_rows, per_block) in locs.items():
            share = -(-len(per_block) // world) * block_rows
            spans.append((fqn, r * share, (r + 1) * share))
        per_rank.append(plan(locs, spans, budget))
    out: list[list[tuple]] = []
    seen: set[bytes] = set()  # a block at the cut is in two ranks' shares
    for k in range(max((len(c) for c in per_rank), default=0)):
        for chains in per_rank:
            if k < len(chains) and chains[k][0][0] not in seen:
                seen.add(chains[k][0][0])
                out.append(chains[k])
    return out


def patches(locs: Locations, spans: list[tuple[str, int, int]] | None = None,
            budget: int = EARLY_BYTES) -> list[tuple]:
    """The patch records (every record of a block's chain but its largest, the full
    block) of the blocks overlapping each (fqn, lo, hi) row span (None: every block), in
    this order, until ``budget`` stored bytes. A window's patches are read before its
    blocks, a few small reads in as many small packs: cold, each stalled its decode
    thread's stream of full blocks for several ms."""
    out: list[tuple] = []
    seen: set[tuple[str, int]] = set()
    total = 0
    if spans is None:
        spans = [(fqn, 0, len(per_block) * block_rows)
                 for fqn, (block_rows, per_block) in locs.items()]
    for fqn, lo, hi in spans:
        if fqn not in locs or hi <= lo:
            continue
        block_rows, per_block = locs[fqn]
        for b in range(lo // block_rows, min(len(per_block), -(-hi // block_rows))):
            if (fqn, b) in seen or len(per_block[b]) < 2:
                continue
            if total >= budget:
                return out
            seen.add((fqn, b))
            sizes = [engine.RecordLocation.from_wire(w).length for w in per_block[b]]
            big = sizes.index(max(sizes))
            out.extend(w for i, w in enumerate(per_block[b]) if i != big)
            total += sum(sizes) - sizes[big]
    return out


def hint(source: Any, chains: list[list[tuple]],
         small: list[tuple] | None = None) -> threading.Thread | None:
    """Hint ``small`` (``patches``'), all at once, then ``chains`` (``plan``'s), block by
    block, through ``source.prefetch_at``, on a thread of its own (the caller goes on to
    DCP's planning rounds)."""
    if not chains and not small:
        return None

    def run() -> None:
        try:
            if small:
                source.prefetch_at([engine.RecordLocation.from_wire(w) for w in small])
            for chain in chains:
                source.prefetch_at([engine.RecordLocation.from_wire(w) for w in chain])
        except Exception:  # noqa: BLE001 - a hint (the store may close meanwhile)
            pass

    return start_thread(run, "cnr-dcp-early")

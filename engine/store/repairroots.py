"""Which roots a repair keeps, and where each one points (docs/FORMAT.md "Recovery and
repair", step 2).

A repair must never make readable data unreadable. So a root whose DAG lost objects (a
flipped byte in one data pack, a deleted pack) keeps its target: everything else it
reaches still reads, and reading a lost object raises the missing-object error naming
it. A root moves or goes only when keeping it would show a user something that never
was, or that nothing of can be read:

- its target came from a commit that never completed (its roots record is newer than
  the sequence the old index had published, and its DAG is incomplete): back to the
  target the index had, or dropped when the name had none;
- its target object itself is lost (nothing of the DAG can even be found): back to the
  newest older target the packs still hold (a complete one first), else dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..api import Problem, RootRepair
from ..format import records as fmt
from ..format.ids import hexid
from ..index import db as ix
from ..packs.pack import pack_name
from .walk import Via, walk

Snapshot = tuple[int, int, int, fmt.RootsRecord, int]  # seq, pack, offset, record, size


@dataclass
class ChosenRoots:
    max_seq: int = 0
    newest_pack: int = -1
    roots: dict[str, bytes] = field(default_factory=dict)
    chain: list[int] = field(default_factory=list)  # [] demands a full snapshot next
    delta_bytes: int = 0
    full_bytes: int = 0
    repairs: list[RootRepair] = field(default_factory=list)  # roots not intact, by name


def lost_under(objects: dict[bytes, ix.ObjectEntry], starts: list[bytes]) -> set[bytes]:
    """The ids reachable from ``starts`` that the scan did not find."""
    lost: set[bytes] = set()

    def refs_of(oid: bytes, via: Via) -> tuple[bytes, ...] | None:
        entry = objects.get(oid)
        if entry is None:
            lost.add(oid)
            return None
        return entry.refs

    walk(((oid, "") for oid in starts), refs_of)
    return lost


def in_order(snapshots: list[Snapshot]) -> list[Snapshot]:
    """The roots records by sequence; of records sharing one (a dead writer's and the
    next commit's) the one with the highest (pack, offset)."""
    by_seq: dict[int, Snapshot] = {}
    for snap in snapshots:
        if snap[0] not in by_seq or snap[1:3] > by_seq[snap[0]][1:3]:
            by_seq[snap[0]] = snap
    return [by_seq[k] for k in sorted(by_seq)]


def choose_roots(snapshots: list[Snapshot], objects: dict[bytes, ix.ObjectEntry],
                 damaged: list[Problem], old_seq: int | None,
                 old_roots: dict[str, bytes] | None = None) -> ChosenRoots:
    """Replay the newest full snapshot and the deltas after it, then decide each root.

    Of records sharing a sequence (a dead writer's and the next commit's) the one with the
    highest (pack, offset) wins. A gap in the delta chain is reported ("roots-gap") and
    the later deltas still apply. ``old_seq`` is the commit sequence the old index had
    published, None when it could not be read (then every commit counts as published);
    ``old_roots`` its roots when they pass their checksum: an index at least as new as
    every roots record the packs still hold names the roots better than a replay that
    lost records to damage ("roots-from-index")."""
    ordered = in_order(snapshots)
    if not ordered:
        return ChosenRoots()
    out = ChosenRoots(max_seq=ordered[-1][0], newest_pack=ordered[-1][1])
    history = _history(ordered)
    start = max((i for i, s in enumerate(ordered) if s[3].full), default=None)
    state: dict[str, bytes] = {}
    regular = start is not None
    prev = ordered[start][0] - 1 if start is not None else None
    for seq, n, offset, rec, size in ordered[start or 0:]:
        if prev is not None and seq != prev + 1:
            regular = False
            damaged.append(Problem(
                "roots-gap", f"roots records {prev + 1}..{seq - 1} are missing or damaged; "
                "later ones applied regardless", pack=pack_name(n), offset=offset))
        prev = seq
        state = rec.apply(state)
        out.chain.append(n)
        out.delta_bytes += 0 if rec.full else size
        out.full_bytes = size if rec.full else out.full_bytes
    if (old_roots is not None and old_seq is not None and old_seq >= out.max_seq
            and old_roots != state):
        state = _merge_index_roots(state, old_roots, objects, damaged,
                                   pack_name(out.newest_pack))
        regular = False
    out.roots = dict(state)
    if lost_under(objects, list(state.values())):  # one walk when nothing is lost
        where = (pack_name(out.newest_pack), ordered[-1][2])
        for name, oid in sorted(state.items()):
            repair = _decide(name, oid, history.get(name, []), objects, old_seq)
            if repair is None:
                continue
            out.repairs.append(repair)
            if repair.target is None:
                del out.roots[name]
            else:
                out.roots[name] = repair.target
            damaged.append(_problem(repair, *where))
    if out.roots != state:  # the packs' chain does not say what the index now holds
        regular = False
    if not regular:
        out.chain, out.delta_bytes = [], 0
    return out


def _merge_index_roots(state: dict[str, bytes], old_roots: dict[str, bytes],
                       objects: dict[bytes, ix.ObjectEntry], damaged: list[Problem],
                       pack: str) -> dict[str, bytes]:
    """The replayed roots with what an index at least as new as every roots record adds:
    names the records lost, and targets the index moved them to (when the packs hold
    them). Never a name less: one only the records name was deleted by a commit whose
    record is lost, or dropped by an earlier repair; keeping it loses nothing."""
    merged = dict(state)
    taken = []
    for name, oid in sorted(old_roots.items()):
        if state.get(name) != oid and (name not in state or oid in objects):
            merged[name] = oid
            taken.append(name)
    for name, oid in sorted(old_roots.items()):
        if name in state and state[name] != oid and oid not in objects:
            damaged.append(Problem(
                "root-rolled-back", f"root {name!r}: the index pointed it at {hexid(oid)}, "
                f"which no pack holds; kept at {hexid(state[name])}, the target the packs' "
                "roots records name", oid=oid, pack=pack))
    if taken:
        damaged.append(Problem(
            "roots-from-index", f"roots records are lost: {len(taken)} roots taken from the "
            f"index (current, roots checksum intact): {', '.join(map(repr, taken[:8]))}"
            + (" ..." if len(taken) > 8 else ""), pack=pack))
    extra = sorted(state.keys() - old_roots.keys())
    if extra:
        damaged.append(Problem(
            "root-not-in-index", f"{len(extra)} roots the packs' roots records name are not "
            f"in the index (deleted by a commit whose roots record is lost, or dropped by "
            f"an earlier repair); kept: {', '.join(map(repr, extra[:8]))}"
            + (" ..." if len(extra) > 8 else ""), pack=pack))
    return merged


def _history(ordered: list[Snapshot]) -> dict[str, list[tuple[int, bytes | None]]]:
    """Per name, each (seq, target) it took, oldest first; None where it was deleted."""
    history: dict[str, list[tuple[int, bytes | None]]] = {}
    current: dict[str, bytes] = {}
    for seq, _, _, rec, _ in ordered:
        after = rec.apply(current)
        for name, oid in after.items():
            if current.get(name) != oid:
                history.setdefault(name, []).append((seq, oid))
        for name in current.keys() - after.keys():
            history[name].append((seq, None))
        current = after
    return history


def _decide(name: str, oid: bytes, history: list[tuple[int, bytes | None]],
            objects: dict[bytes, ix.ObjectEntry], old_seq: int | None) -> RootRepair | None:
    lost = lost_under(objects, [oid])
    if not lost:
        return None
    set_at = next((s for s, o in reversed(history) if o == oid), None)
    if old_seq is not None and set_at is not None and set_at > old_seq:
        before = next((o for s, o in reversed(history) if s <= old_seq), None)
        why = (f"its commit (roots record {set_at}) never completed: the index had "
               f"published up to {old_seq}, and its objects are not all in the packs")
        if before is None:
            return RootRepair(name, oid, "dropped", None, why, tuple(sorted(lost)))
        return RootRepair(name, oid, "rolled-back", before,
                          why + f"; back to the target the index had, {hexid(before)}",
                          tuple(sorted(lost)))
    if oid in objects:
        refs = objects[oid].refs
        branches = tuple((r, tuple(sorted(lost_under(objects, [r])))) for r in refs)
        return RootRepair(name, oid, "damaged", oid,
                          f"kept: {len(lost)} objects it reaches are lost; everything else "
                          "it reaches still reads", tuple(sorted(lost)),
                          tuple(b for b in branches if b[1]))
    older = [o for _, o in reversed(history) if o is not None and o != oid and o in objects]
    older.sort(key=lambda o: bool(lost_under(objects, [o])))  # stable: complete first
    why = "its root object itself is in no pack, so nothing of it can be read"
    if older:
        return RootRepair(name, oid, "rolled-back", older[0],
                          why + f"; back to its older target {hexid(older[0])}",
                          tuple(sorted(lost)))
    return RootRepair(name, oid, "dropped", None, why, tuple(sorted(lost)))


def _problem(r: RootRepair, pack: str, offset: int) -> Problem:
    what = {"damaged": "damaged-root", "rolled-back": "root-rolled-back",
            "dropped": "dangling-root"}[r.action]
    return Problem(what, f"root {r.name!r} -> {hexid(r.oid)} reaches {len(r.lost)} lost "
                   f"objects; {r.reason}", oid=r.oid, pack=pack, offset=offset)

"""Integrity checks of what the roots reach (docs/FORMAT.md "Verify").

Structural: every reachable id is indexed, its pack is indexed and on disk and long enough
to hold the record. Deep: additionally read every reachable record and check its checksum
and id. Damage is reported as ``Problem`` values, never raised.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..api import Problem, ProgressFn, StoreVerifyReport
from ..errors import CorruptObject, ObjectNotFound, StoreError
from ..format.ids import ID_SIZE, check_root_name, hexid
from ..index import db as ix
from ..packs.pack import pack_name
from .walk import Via, describe, walk

if TYPE_CHECKING:
    from .core import PackStoreState


def _walk(store: PackStoreState, names: list[str] | None
          ) -> tuple[dict[bytes, ix.ObjectEntry], list[Problem], set[int]]:
    """Reachable entries and the structural problems met on the way (one read txn)."""
    index = store.index

    def read(txn: Any) -> tuple[dict[bytes, ix.ObjectEntry], list[Problem], set[int]]:
        problems: list[Problem] = []
        found: dict[bytes, ix.ObjectEntry] = {}
        roots_problem = ix.roots_problem(txn, index)
        if roots_problem is not None:
            problems.append(Problem("corrupt-roots", roots_problem))
        all_roots = {}
        for k, v in txn.cursor(db=index.roots):
            name = bytes(k).decode("utf-8", "backslashreplace")
            if name.encode("utf-8", "surrogatepass") != bytes(k):
                problems.append(Problem("corrupt-root", f"root name {bytes(k)!r} is not utf-8"))
            if len(v) != ID_SIZE:
                problems.append(Problem("corrupt-root", f"root {name!r} holds a malformed id"))
                continue
            all_roots[name] = bytes(v)
        wanted = all_roots if names is None else {n: all_roots.get(n) for n in names}
        starts = []
        for name, oid in wanted.items():
            if oid is None:
                problems.append(Problem("missing-root", f"root {name!r} does not exist"))
            elif txn.get(oid, db=index.objects) is None:
                problems.append(Problem("dangling-root",
                                        f"root {name!r} points at missing object {hexid(oid)}",
                                        oid=oid))
            else:
                starts.append((oid, name))

        def refs_of(oid: bytes, via: Via) -> tuple[bytes, ...] | None:
            raw = txn.get(oid, db=index.objects)
            if raw is None:
                problems.append(Problem("missing", f"object {hexid(oid)} (ref of "
                                        f"{describe(via)}) is not in the index", oid=oid))
                return None
            try:
                entry = index.entry(oid, raw)
            except CorruptObject as exc:
                problems.append(Problem("corrupt-entry", f"{exc} (ref of {describe(via)})",
                                        oid=oid))
                return None
            found[oid] = entry
            return entry.refs

        walk(starts, refs_of)
        packs = {ix.unpack_pack_key(k) for k, _ in txn.cursor(db=index.packs)}
        return found, problems, packs

    return index.read(read)


def _pack_problem(store: PackStoreState, oid: bytes, e: ix.ObjectEntry, packs: set[int],
                  sizes: dict[int, int]) -> Problem | None:
    name = pack_name(e.pack)
    if e.pack not in packs:
        return Problem("missing-pack", f"object {hexid(oid)}: pack {name} is not indexed",
                       oid=oid, pack=name, offset=e.offset)
    if e.pack not in sizes:
        try:
            sizes[e.pack] = store.storage.size(e.pack)
        except FileNotFoundError:
            sizes[e.pack] = -1
    if sizes[e.pack] < 0:
        return Problem("missing-pack", f"object {hexid(oid)}: pack file {name} is missing",
                       oid=oid, pack=name, offset=e.offset)
    if sizes[e.pack] < e.offset + e.length:
        return Problem("truncated", f"object {hexid(oid)}: pack {name} ends at "
                       f"{sizes[e.pack]}, before its record ends at {e.offset + e.length}",
                       oid=oid, pack=name, offset=e.offset)
    return None


def verify(store: PackStoreState, *, deep: bool, roots: Iterable[str] | None,
           progress: ProgressFn | None) -> StoreVerifyReport:
    names = None
    if roots is not None:
        if isinstance(roots, str):
            raise TypeError("roots must be an iterable of root names, not a single str")
        names = list(roots)
        for n in names:
            check_root_name(n)
    damaged = store.index.trees_problem()
    if damaged is not None:  # reading objects would run LMDB off the file's end
        return StoreVerifyReport(False, (Problem("damaged-index", f"index {store.index.path}: "
                                            f"{damaged} (repair rebuilds it from the packs)"),),
                            0, 0)
    found, problems, packs = _walk(store, names)
    sizes: dict[int, int] = {}
    total = len(found)
    nbytes = 0
    for done, (oid, entry) in enumerate(found.items(), 1):
        problem = _pack_problem(store, oid, entry, packs, sizes)
        if problem is not None:
            # A concurrent gc (another process) may have moved the object: look again.
            problem = _recheck(store, oid, problem)
        if problem is None and deep:
            problem = _deep_check(store, oid)
            nbytes += entry.raw_len
        if problem is not None:
            problems.append(problem)
        if progress:
            progress(done, total)
    return StoreVerifyReport(not problems, tuple(problems), total, nbytes)


def _recheck(store: PackStoreState, oid: bytes, problem: Problem) -> Problem | None:
    try:
        entry = store.lookup(oid)
    except ObjectNotFound:
        # Indexed during the walk, gone now: a concurrent gc swept it (its root was
        # dropped after the walk). Nothing reachable is damaged.
        return None
    # Checked again against a fresh listing of the packs, also when the entry still names
    # the pack of the problem: a gc that merged packs meanwhile indexes the object in a
    # pack made after the walk listed the packs ("not indexed" there, yet whole).
    return _pack_problem(store, oid, entry, _listed(store), {})


def _listed(store: PackStoreState) -> set[int]:
    index = store.index
    return set(index.read(lambda t: [ix.unpack_pack_key(k) for k, _ in t.cursor(db=index.packs)]))


def _deep_check(store: PackStoreState, oid: bytes) -> Problem | None:
    try:
        store.check(oid)
    except CorruptObject as exc:
        return Problem("corrupt", str(exc), oid=oid, pack=exc.pack, offset=exc.offset)
    except ObjectNotFound:
        return None  # swept by a concurrent gc since the walk (see _recheck)
    except StoreError as exc:
        return Problem("unreadable", str(exc), oid=oid)
    return None

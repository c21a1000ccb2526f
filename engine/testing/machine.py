"""A Hypothesis state machine that drives a store through put / set_root / create_root /
delete_root / gc / verify / close+reopen / repair / aborted and abandoned writers, and
checks it against a plain model after every step (docs/ARCHITECTURE.md "The engine").

The model is deliberately not MemoryStore: it is the contract written out in a few lines
(committed objects, roots, mark & sweep), so it also checks the in-memory twin itself.
A store runs it by subclassing ``StoreMachine`` (``open``, ``real``, ``stored_bytes``);
tests/engine/test_state_machine*.py run it over the twin, a directory, a shared directory
and S3. Needs pytest and hypothesis (the test extra).
"""

from __future__ import annotations

import gc as gc_module
import random
import shutil
import struct
import tempfile

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ..api import Object, ObjectStore
from ..errors import ObjectNotFound, RootExists, StoreLocked
from ..format.ids import object_id
from ..store.memory import MemoryStore

_HEAD = struct.Struct("<QQ")


def make_payload(seed: int, size: int) -> bytes:
    """A self-describing payload (seed and size in its first 16 bytes, the rest derived
    from the seed): any process can tell a right payload from a wrong one."""
    size = max(size, _HEAD.size)
    body = random.Random(seed).randbytes(size - _HEAD.size)
    return _HEAD.pack(seed, size) + body


def payload_ok(payload: bytes) -> bool:
    """True if ``payload`` is exactly what make_payload wrote for its own header."""
    if len(payload) < _HEAD.size:
        return False
    seed, size = _HEAD.unpack_from(payload)
    return len(payload) == size and payload == make_payload(seed, size)


ROOT_NAMES = ("step/1", "step/2", "step/10", "latest", "é-ünïcode")

# Small random payloads, plus self-describing ones from a few seeds so that the same
# bytes come back often (dedup) and some are big enough to span pages and packs.
payloads = st.one_of(
    st.binary(max_size=200),
    st.builds(
        make_payload,
        st.integers(0, 5),
        st.sampled_from([16, 4096, 65536 + 3, 300_000]),
    ),
)


class StoreMachine(RuleBasedStateMachine):
    """The machine over the memory twin; a subclass sets ``real`` (reopen, repair,
    abandoned writers) and overrides ``open`` (and ``stored_bytes``) for its store."""

    real = False

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="cnr-sm-")
        self.store = self.open()
        self.objects: dict[bytes, Object] = {}  # committed
        self.roots: dict[str, bytes] = {}
        self.seen: list[bytes] = []  # every id ever put, committed or not, swept or not

    def open(self) -> ObjectStore:
        """The store under test, opened again after ``reopen`` (``self.dir`` is a fresh
        temporary directory per run): a subclass runs the machine on its backend."""
        return MemoryStore()

    def stored_bytes(self) -> int | None:
        """What ``stats().stored_bytes`` must say now (None: not checked)."""
        return None

    def teardown(self) -> None:
        try:
            self.store.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules -----------------------------------------------------------------------
    @rule(data=st.data(), commit=st.booleans(), nops=st.integers(1, 5))
    def write(self, data: st.DataObject, commit: bool, nops: int) -> None:
        new: dict[bytes, Object] = {}
        roots = dict(self.roots)
        reused = 0
        moved = False  # root ops, even ones that end where they started, write a snapshot
        w = self.store.writer()
        try:
            for _ in range(nops):
                visible = list(self.objects) + list(new)
                op = data.draw(st.sampled_from(["put", "put", "put", "root", "create", "unroot",
                                                "bad"]))
                if op == "put":
                    kind = data.draw(st.integers(0, 255))
                    refs = []
                    if visible:
                        refs = data.draw(st.lists(st.sampled_from(visible), max_size=3))
                    payload = data.draw(payloads)
                    oid = w.put(kind, payload, refs, meta=data.draw(st.booleans()))
                    assert oid == object_id(kind, refs, payload)
                    assert w.has(oid)
                    self.seen.append(oid)
                    if oid in self.objects or oid in new:
                        reused += 1
                    else:
                        new[oid] = Object(kind, tuple(refs), payload)
                elif op == "root" and visible:
                    name = data.draw(st.sampled_from(ROOT_NAMES))
                    target = data.draw(st.sampled_from(visible))
                    w.set_root(name, target)
                    roots[name] = target
                    moved = True
                elif op == "create" and visible:
                    name = data.draw(st.sampled_from(ROOT_NAMES))
                    target = data.draw(st.sampled_from(visible))
                    if name in roots:
                        with pytest.raises(RootExists):
                            w.create_root(name, target)
                    else:
                        w.create_root(name, target)
                        roots[name] = target
                        moved = True
                elif op == "unroot":
                    name = data.draw(st.sampled_from(ROOT_NAMES))
                    if name in roots:
                        w.delete_root(name)
                        del roots[name]
                        moved = True
                    else:
                        with pytest.raises(ObjectNotFound):
                            w.delete_root(name)
                elif op == "bad":
                    # A dangling ref or root target is refused and leaves the writer usable.
                    ghost = object_id(0, (), data.draw(st.binary(min_size=1, max_size=8)) + b"!")
                    if ghost not in self.objects and ghost not in new:
                        with pytest.raises(ObjectNotFound):
                            w.put(1, b"x", [ghost])
                        with pytest.raises(ObjectNotFound):
                            w.set_root("latest", ghost)
            if not commit:
                w.abort()
                return
            info = w.commit()
        except BaseException:
            w.abort()
            raise
        assert info.objects_new == len(new)
        assert info.objects_reused == reused
        if not new and not moved:
            assert info.bytes_written == 0
        if new and self.real:
            assert info.bytes_written > 0  # headers at least, even for empty payloads
        self.objects.update(new)
        self.roots = roots

    @rule(threshold=st.sampled_from([0.0, 0.25, 1.0]))
    def gc(self, threshold: float) -> None:
        live = self._reachable()
        report = self.store.gc(threshold=threshold)
        assert report.objects_live == len(live)
        assert report.objects_freed == len(self.objects) - len(live)
        assert report.bytes_freed >= 0
        self.objects = {oid: obj for oid, obj in self.objects.items() if oid in live}

    @precondition(lambda self: self.real)
    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = self.open()

    @precondition(lambda self: self.real)
    @rule()
    def repair_then_gc(self) -> None:
        # Repair rebuilds the index from the packs: roots and everything they reach come
        # back exactly. Objects gc swept from the index but not yet compacted out of their
        # packs may come back too (repair cannot know they were swept), so a gc follows
        # and the model keeps only what is reachable.
        live = self._reachable()
        report = self.store.repair()
        assert report.damaged == ()
        assert report.roots_restored == len(self.roots)
        assert report.objects_indexed >= len(live)
        self.roots_match()
        self.reachable_objects_read_back()
        self.store.gc(threshold=0.0)
        self.objects = {oid: obj for oid, obj in self.objects.items() if oid in live}

    @precondition(lambda self: self.real)
    @rule(payload=payloads)
    def abandoned_writer(self, payload: bytes) -> None:
        # A writer dropped without commit or abort (an exception path that lost it) must
        # not leave the store locked nor its puts visible.
        w = self.store.writer()
        oid = w.put(9, payload)
        self.seen.append(oid)
        del w
        gc_module.collect()
        self.store.writer(timeout=5).abort()

    @rule()
    def writer_is_exclusive(self) -> None:
        w = self.store.writer()
        try:
            with pytest.raises(StoreLocked):
                self.store.writer(timeout=0)
            with pytest.raises(StoreLocked):
                self.store.gc(timeout=0)
        finally:
            w.abort()

    @rule(deep=st.booleans())
    def verify(self, deep: bool) -> None:
        report = self.store.verify(deep=deep)
        assert report.ok, report.problems
        assert report.problems == ()
        assert report.objects_checked == len(self._reachable())
        if deep:
            live = self._reachable()
            assert report.bytes_checked >= sum(len(self.objects[o].payload) for o in live)

    # -- invariants ------------------------------------------------------------------
    def _reachable(self) -> set[bytes]:
        live: set[bytes] = set()
        stack = list(self.roots.values())
        while stack:
            oid = stack.pop()
            if oid not in live:
                live.add(oid)
                stack.extend(self.objects[oid].refs)
        return live

    @invariant()
    def roots_match(self) -> None:
        assert self.store.roots() == self.roots
        for name in ROOT_NAMES:
            assert self.store.root(name) == self.roots.get(name)

    @invariant()
    def reachable_objects_read_back(self) -> None:
        for oid in self._reachable():
            want = self.objects[oid]
            assert self.store.get(oid) == want
            info = self.store.info(oid)
            assert (info.kind, info.refs, info.raw_len) == (want.kind, want.refs, len(want.payload))

    @invariant()
    def membership_matches(self) -> None:
        for oid in self.seen[-60:]:
            assert self.store.has(oid) == (oid in self.objects)
            if oid not in self.objects:
                with pytest.raises(ObjectNotFound):
                    self.store.get(oid)

    @invariant()
    def stats_match(self) -> None:
        stats = self.store.stats()
        assert stats.objects == len(self.objects)
        assert stats.logical_bytes == sum(len(o.payload) for o in self.objects.values())
        assert stats.roots == len(self.roots)
        if self.real:
            assert (stats.stored_bytes > 0) == (stats.packs > 0)
        stored = self.stored_bytes()
        if stored is not None:
            assert stats.stored_bytes == stored

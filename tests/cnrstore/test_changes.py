"""store.changes(a, b) (issue 28): replaying the changes onto step a's tables gives step
b's, bit for bit; only rows whose stored values differ are reported; tables added,
dropped and reshaped are announced; a rollback (a > b) works; the cost is what was
written between the steps, not the tables. Properties over random put sequences with
hypothesis (a longer state machine under -m slow)."""

from __future__ import annotations

import pytest
import torch
from _servers import moto_s3  # noqa: F401 - the fixture, registered by import
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cnrstore
import engine

OPTS = {"block_rows": 8, "fanout": 2}


def _store(objects=None, **opts) -> cnrstore.CheckpointStore:
    return cnrstore.CheckpointStore(objects or engine.MemoryStore(), **{**OPTS, **opts})


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(t.shape[0], -1).view(torch.uint8) if t.numel() else (
        torch.zeros((t.shape[0], 0), dtype=torch.uint8))


def replay(store, a: int, b: int, names=None) -> dict:
    tables = store.get_tables(a, names=[n for n in (names or store.get_tables(a))
                                        if n in store.get_tables(a)])
    for ch in store.changes(a, b, names):
        ch.apply(tables)
    return tables


def assert_same(got: dict, want: dict) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for n, w in want.items():
        g = got[n]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), n
        assert torch.equal(_bytes(g), _bytes(w)), n  # bits: NaN payloads too


def expected_rows(ta: torch.Tensor | None, tb: torch.Tensor) -> list[int]:
    """Rows of b whose stored values differ from a's (every row if a has another
    dtype or row shape, or none)."""
    if ta is None or ta.dtype != tb.dtype or ta.shape[1:] != tb.shape[1:]:
        return list(range(tb.shape[0]))
    n = min(ta.shape[0], tb.shape[0])
    differ = (_bytes(ta[:n]) != _bytes(tb[:n])).any(dim=1).nonzero().flatten().tolist()
    return differ + list(range(n, tb.shape[0]))


def check_pair(store, a: int, b: int, *, strict: bool = True) -> None:
    """Replaying changes(a, b) gives b; strict: exactly the rows whose stored values
    differ are reported, else at least those."""
    want = store.get_tables(b)
    assert_same(replay(store, a, b), want)
    before = store.get_tables(a)
    rows: dict[str, list[int]] = {}
    for ch in store.changes(a, b, strict=strict):
        assert ch.kind in ("rows", "added", "dropped", "reshaped")
        if ch.kind == "rows":
            r = ch.rows.tolist()
            assert r == sorted(r) and ch.values.shape == (len(r), *want[ch.table].shape[1:])
            rows.setdefault(ch.table, []).extend(r)
    for n, tb in want.items():
        got, exp = rows.get(n, []), expected_rows(before.get(n), tb)
        assert len(got) == len(set(got)), (a, b, n)
        if strict:
            assert sorted(got) == exp, (a, b, n)
        else:
            assert set(exp) <= set(got), (a, b, n)


def _t(rows: int, width: int = 4, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_changes_of_one_step_are_the_written_rows_with_their_values():
    s = _store()
    t = _t(100)
    s.put_tables(1, {"u": t.clone()})
    t[[3, 40, 99]] += 1
    s.put_tables(2, {"u": t.clone()})
    (ch,) = list(s.changes(1, 2))
    assert isinstance(ch, cnrstore.Change) and ch.kind == "rows" and ch.table == "u"
    assert ch.rows.tolist() == [3, 40, 99] and ch.rows.dtype == torch.int64
    assert torch.equal(ch.values, t[[3, 40, 99]])
    assert (ch.shape, ch.dtype, ch.scheme) == ((100, 4), torch.float32, "exact")
    check_pair(s, 1, 2)
    check_pair(s, 2, 1)  # a later than b: the changes roll a replica back


def test_a_row_written_back_is_not_a_change():
    s = _store()
    t = _t(40)
    s.put_tables(1, {"u": t.clone()})
    old = t[5].clone()
    t[5] += 1
    t[9] += 1
    s.put_tables(2, {"u": t.clone()})
    t[5] = old  # row 5 holds what step 1 held again, in a second patch of the chain
    s.put_tables(3, {"u": t.clone()})
    # Step 1's block is full: telling row 5 apart reads it, which only strict does.
    assert [c.rows.tolist() for c in s.changes(1, 3)] == [[5, 9]]
    assert [c.rows.tolist() for c in s.changes(1, 3, strict=True)] == [[9]]
    assert [c.rows.tolist() for c in s.changes(3, 1)] == [[9]]  # reads step 1 anyway
    kept = t[9].clone()
    t[9] += 1
    s.put_tables(4, {"u": t.clone()})
    t[9] = kept  # back to step 3's value, which step 3's own patch holds: found unread
    s.put_tables(5, {"u": t.clone()})
    assert list(s.changes(3, 5)) == []


def test_lossy_rows_whose_codes_stay_are_not_changes():
    s = _store()
    t = _t(40)
    s.put_tables(1, {"u": t.clone()}, quant="int8")
    t[2] += 1.0
    t[7] += 1e-7  # changes the value, not its int8 codes
    s.put_tables(2, {"u": t.clone()}, quant="int8")
    assert [c.rows.tolist() for c in s.changes(1, 2)] == [[2, 7]]
    chs = list(s.changes(1, 2, strict=True))
    assert [c.rows.tolist() for c in chs] == [[2]]
    assert torch.equal(chs[0].values, s.get_tables(2)["u"][[2]])
    check_pair(s, 1, 2)


def test_added_dropped_grown_shrunk_and_retyped_tables_are_reported():
    s = _store()
    s.put_tables(1, {"grow": _t(10), "shrink": _t(30), "retype": _t(12), "gone": _t(5),
                     "scheme": _t(20)})
    s.put_tables(2, {"grow": torch.cat([_t(10), _t(9, seed=1)]), "shrink": _t(30)[:17],
                     "retype": _t(12).double(), "new": torch.arange(7),
                     "scheme": _t(20)}, quant={"scheme": "fp16"})
    kinds = {(c.table, c.kind) for c in s.changes(1, 2) if c.kind != "rows"}
    assert kinds == {("grow", "reshaped"), ("shrink", "reshaped"), ("retype", "reshaped"),
                     ("gone", "dropped"), ("new", "added")}
    shapes = {c.table: c.shape for c in s.changes(1, 2) if c.kind != "rows"}
    assert shapes["grow"] == (19, 4) and shapes["shrink"] == (17, 4)
    assert shapes["gone"] is None and shapes["new"] == (7,)
    check_pair(s, 1, 2)
    check_pair(s, 2, 1)


def test_changes_of_a_step_with_itself_and_bad_requests():
    s = _store()
    s.put_tables(1, {"u": _t(10)})
    s.put_tables(2, {"u": _t(10, seed=2)})
    assert list(s.changes(2, 2)) == []
    (ch,) = list(s.changes(1, 2))
    with pytest.raises(cnrstore.InvalidInput, match="replica"):
        ch.apply({})
    s.delete_step(1)
    with pytest.raises(cnrstore.StepNotFound):
        s.changes(1, 2)  # raised by the call, not by the first next()
    with pytest.raises(cnrstore.TableNotFound):
        s.changes(2, 2, ["nope"])
    with pytest.raises(cnrstore.InvalidType):
        s.changes(2, 2, "u")
    with pytest.raises(cnrstore.InvalidInput):
        s.changes(2, 2, rows={"u": slice(0, 10, 2)})
    with pytest.raises(cnrstore.InvalidInput):
        s.changes(-1, 2)


def test_a_step_collected_while_its_changes_are_read_is_step_not_found(tmp_path):
    s = cnrstore.open(tmp_path / "s", **OPTS)
    t = _t(64)
    s.put_tables(1, {"u": t.clone(), "v": t.clone()})
    t += 1  # every block rewritten: step 1's blocks are read by the changes
    s.put_tables(2, {"u": t.clone(), "v": t.clone()})
    it = s.changes(1, 2)
    assert next(it).table == "u"
    s.delete_step(1)
    s.gc(threshold=0.0)
    with pytest.raises(cnrstore.StepNotFound, match="deleted while its changes"):
        list(it)
    s.close()


def test_names_and_rows_pick_what_is_read():
    s = _store()
    t, v = _t(64), _t(16, seed=3)
    s.put_tables(1, {"u": t.clone(), "v": v.clone()})
    t[[1, 20, 33, 60]] += 1
    v[0] += 1
    s.put_tables(2, {"u": t.clone(), "v": v.clone()})
    assert {c.table for c in s.changes(1, 2, ["v"])} == {"v"}
    got = [r for c in s.changes(1, 2, rows={"u": slice(16, 40)}) if c.table == "u"
           for r in c.rows.tolist()]
    assert got == [20, 33]
    assert {c.table for c in s.changes(1, 2, rows={"u": slice(16, 40)})} == {"u", "v"}


class CountingStore(engine.MemoryStore):
    """A MemoryStore that counts the payload bytes read through get."""

    def __init__(self):
        super().__init__()
        self.read = 0

    def get(self, oid):
        obj = super().get(oid)
        self.read += len(obj.payload)
        return obj


def test_changes_read_the_patches_not_the_tables():
    objects = CountingStore()
    s = _store(objects, block_rows=256, fanout=4)
    t = _t(256 * 64, width=16)   # 64 blocks of 16 KiB
    s.put_tables(1, {"u": t.clone()})
    for step in (2, 3):
        t[torch.arange(5, 256 * 64, 997)] += step
        s.put_tables(step, {"u": t.clone()})
    objects.read = 0
    rows = sum(len(c.rows) for c in s.changes(1, 3))
    assert rows == len(range(5, 256 * 64, 997))
    table_bytes = t.numel() * 4
    assert objects.read < table_bytes // 20, (objects.read, table_bytes)
    objects.read = 0
    assert sum(len(c.rows) for c in s.changes(3, 1)) == rows  # reads step 1's blocks
    assert objects.read < 1.5 * table_bytes
    objects.read = 0
    assert sum(len(c.rows) for c in s.changes(1, 3, strict=True)) == rows
    assert objects.read > table_bytes // 4  # rows written twice: step 1's blocks read
    objects.read = 0
    assert sum(len(c.rows) for c in s.changes(2, 3, strict=True)) == rows
    assert objects.read < table_bytes // 20  # one step: its patches only


@pytest.fixture(params=["shared", "s3"])
def remote(request, tmp_path):
    """(location, storage options) of a store on a shared directory or a moto bucket."""
    if request.param == "shared":
        return str(tmp_path / "shared"), {"gc_grace_s": 0.0}
    pytest.importorskip("obstore")
    server = request.getfixturevalue("moto_s3")
    return server.url(), server.options


def test_changes_on_shared_directory_and_s3_stores(remote, tmp_path):
    url, options = remote
    t = _t(100)
    with cnrstore.open(url, cache_dir=tmp_path / "c0", storage_options=options, **OPTS) as s:
        s.put_tables(1, {"u": t.clone()})
        t[[3, 50, 99]] += 1
        s.put_tables(2, {"u": t.clone(), "v": torch.arange(4)}, quant={"u": "int8"})
        t[[50]] -= 3
        s.put_tables(3, {"u": t.clone()}, quant={"u": "int8"})
        for a, b in ((1, 3), (3, 1), (2, 3)):
            check_pair(s, a, b)
    # Another host's empty cache, rebuilt from the storage, sees the same changes.
    with cnrstore.open(url, cache_dir=tmp_path / "c1", storage_options=options) as s:
        assert [(c.kind, c.rows.tolist()) for c in s.changes(2, 3)] == [
            ("rows", [50]), ("dropped", [])]
        check_pair(s, 2, 3)


# -- properties -------------------------------------------------------------------------

_SCHEMES = st.sampled_from(["exact", "exact", "fp16", "int8"])


@st.composite
def _puts(draw):
    """A put sequence: per step, per table, (rows, scheme, rows to touch, seed)."""
    n = draw(st.integers(2, 5))
    out = []
    for _ in range(n):
        step = {}
        for name in draw(st.sets(st.sampled_from(["a", "b", "c"]), min_size=1)):
            step[name] = (draw(st.integers(0, 30)), draw(_SCHEMES),
                          draw(st.lists(st.integers(0, 29), max_size=6)),
                          draw(st.booleans()))
        out.append((step, draw(st.sampled_from(["put", "put", "rollback", "gc"]))))
    return out


def _run(puts) -> cnrstore.CheckpointStore:
    s = _store()
    cur: dict[str, torch.Tensor] = {}
    step = 0
    for spec, then in puts:
        tables, quant = {}, {}
        for name, (rows, scheme, touch, wide) in spec.items():
            t = cur.get(name)
            width = 3 if wide and name != "c" else 2
            if t is None or t.shape[1] != width:
                t = _t(rows, width=width, seed=step)
            elif rows > t.shape[0]:
                t = torch.cat([t, _t(rows - t.shape[0], width=width, seed=step + 99)])
            else:
                t = t[:rows].clone()
            for r in touch:
                if r < t.shape[0]:
                    t[r] += 1.0
            tables[name], quant[name] = t, scheme
        step += 1
        s.put_tables(step, tables, quant=quant)
        cur = {n: v.clone() for n, v in tables.items()}
        if then == "rollback" and len(s.steps()) > 1:
            s.rollback(s.steps()[-2])
            cur = {n: v.clone() for n, v in s.get_tables().items()}
        elif then == "gc" and len(s.steps()) > 2:
            kept = s.steps()
            s.gc(keep=[kept[0], kept[-1]])
    return s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_puts())
def test_replaying_changes_gives_every_kept_step(puts):
    s = _run(puts)
    steps = s.steps()
    for a in steps:
        for b in steps:
            check_pair(s, a, b, strict=True)
            check_pair(s, a, b, strict=False)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_puts())
def test_changes_compose(puts):
    s = _run(puts)
    steps = s.steps()
    if len(steps) < 3:
        steps = steps + steps[-1:]
    a, b, c = steps[0], steps[len(steps) // 2], steps[-1]
    two = replay(s, a, b)
    for ch in s.changes(b, c):
        ch.apply(two)
    assert_same(two, replay(s, a, c))


class ChangesMachine(RuleBasedStateMachine):
    """Puts, rollbacks and gc in any order; every kept pair replays exactly."""

    def __init__(self):
        super().__init__()
        self.s = _store()
        self.step = 0
        self.cur: dict[str, torch.Tensor] = {}

    @rule(name=st.sampled_from(["a", "b"]), rows=st.integers(0, 40),
          touch=st.lists(st.integers(0, 39), max_size=8), scheme=_SCHEMES)
    def put(self, name, rows, touch, scheme):
        t = self.cur.get(name, _t(rows, seed=self.step))
        t = torch.cat([t, _t(max(rows - t.shape[0], 0), seed=self.step + 7)])[:rows].clone()
        for r in touch:
            if r < rows:
                t[r] -= 0.5
        self.cur[name] = t
        self.step += 1
        self.s.put_tables(self.step, dict(self.cur), quant={n: scheme for n in self.cur})

    @precondition(lambda self: len(self.s.steps()) > 1)
    @rule(data=st.data())
    def rollback(self, data):
        to = data.draw(st.sampled_from(self.s.steps()[:-1]))
        self.s.rollback(to)
        self.cur = {n: v.clone() for n, v in self.s.get_tables(to).items()}

    @precondition(lambda self: len(self.s.steps()) > 2)
    @rule(data=st.data())
    def gc(self, data):
        steps = self.s.steps()
        keep = data.draw(st.lists(st.sampled_from(steps), min_size=1, max_size=3))
        self.s.gc(keep=keep + [steps[-1]])

    @invariant()
    def pairs_replay(self):
        steps = self.s.steps()
        for a in steps[-3:]:
            for b in steps:
                check_pair(self.s, a, b, strict=a % 2 == 0)


ChangesMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=12,
                                            deadline=None)
TestChangesMachine = pytest.mark.slow(ChangesMachine.TestCase)

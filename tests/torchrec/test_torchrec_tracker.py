"""touched= from TorchRec's ModelDeltaTracker: its shard-local ids become global rows of the
tables and their optimizer states; a tracker-driven put writes no more than a
fingerprint-driven one and stores the same tables; ids of a failed put are not lost."""

from __future__ import annotations

import pytest
import torch

from cnrstore.distributed.shard import Shard
from cnrstore.distributed.torchrec import is_tracker, resolve_touched, touched_rows
from cnrstore.errors import InvalidInput


class FakeTracker:
    """The duck type of a tracker (pure bookkeeping, so a stand-in is fair here; the real
    ModelDeltaTracker is exercised in the spawned test below)."""

    def __init__(self, ids, table_to_fqn=None, old_api=False):
        self.ids, self.calls = ids, 0
        if table_to_fqn is not None:
            self.table_to_fqn = table_to_fqn
        name = "get_delta_ids" if old_api else "get_unique_ids"
        setattr(self, name, self._get)

    def _get(self, consumer=None):
        self.calls += 1
        ids, self.ids = self.ids, {}
        return ids


def _state():
    # this rank: rows 10..14 and 30..33 of "a" (two pieces), rows 0..5 of "b", none of "c"
    a = [Shard(torch.zeros(5, 2), row_offset=10, rows=40),
         Shard(torch.zeros(4, 2), row_offset=30, rows=40)]
    return {"model": {"m.ebc.a.weight": a[0], "m.ebc.b.weight": Shard(torch.zeros(6, 3), 0, 6),
                      "m.ebc.c.weight": Shard(torch.zeros(0, 3), 0, 9), "dense": torch.ones(2)},
            "optim": {"state": {"m.ebc.b.weight": {"b.momentum1": Shard(torch.zeros(6), 0, 6)}}}}


def test_local_ids_become_global_rows_of_the_table_and_its_optimizer_state():
    tr = FakeTracker({"m.ebc.b": torch.tensor([5, 0, 5])}, {"a": "m.ebc.a", "b": "m.ebc.b",
                                                             "c": "m.ebc.c"})
    assert is_tracker(tr) and not is_tracker({"x": [1]})
    got = touched_rows(tr, _state())
    assert {k: v.tolist() for k, v in got.items()} == {
        "model/m.ebc.b.weight": [0, 5], "optim/state/m.ebc.b.weight/b.momentum1": [0, 5],
        "model/m.ebc.a.weight": [], "model/m.ebc.c.weight": []}  # covered, not looked up


def test_ids_over_several_local_pieces_and_the_old_api():
    st = _state()
    pieces = st["model"]["m.ebc.a.weight"] = [Shard(torch.zeros(5, 2), 10, 40),
                                              Shard(torch.zeros(4, 2), 30, 40)]
    from cnrstore.distributed import torchrec as ctr

    # a list of Shards is one leaf to the store; the tracker counts rows across pieces
    ids = ctr._to_global("a", pieces[0], torch.tensor([0, 4]))
    assert ids.tolist() == [10, 14]
    tr = FakeTracker({"m.ebc.b.weight": torch.tensor([1])}, old_api=True)  # key with .weight
    assert touched_rows(tr, st)["model/m.ebc.b.weight"].tolist() == [1]
    with pytest.raises(InvalidInput, match="holds 6 rows"):
        touched_rows(FakeTracker({"m.ebc.b": torch.tensor([6])}), st)
    with pytest.raises(InvalidInput, match="no sharded entry"):
        touched_rows(FakeTracker({"m.ebc.zz": torch.tensor([1])}), st)


def test_ids_of_a_put_that_failed_are_given_again():
    st = _state()
    tr = FakeTracker({"m.ebc.b": torch.tensor([1])})
    rows, done = resolve_touched(tr, st)  # the put then fails: done() is not called
    assert rows["model/m.ebc.b.weight"].tolist() == [1]
    tr.ids = {"m.ebc.b": torch.tensor([3])}
    rows, done = resolve_touched(tr, st)
    assert rows["model/m.ebc.b.weight"].tolist() == [1, 3]
    done()  # this put returned
    tr.ids = {"m.ebc.b": torch.tensor([4])}
    rows, _ = resolve_touched(tr, st)
    assert rows["model/m.ebc.b.weight"].tolist() == [4]
    assert resolve_touched({"x": [1]}, st)[0] == {"x": [1]}


def _tracker_worker(rank, world, path_a, path_b):
    import torch.distributed as dist
    import trmodels
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig

    import cnrstore
    from cnrstore.distributed import torchrec as ctr
    from cnrstore.errors import StepExists

    layout = {"t0": "tw:1", "t1": "rw", "t2": "twrw"}
    m = trmodels.dmp("ebc", layout, world, rows=(400, 300, 200))
    tracker = m.init_torchrec_delta_tracker(DeltaTrackerConfig())
    a = cnrstore.open(path_a, group=dist.group.WORLD, block_rows=16)
    b = cnrstore.open(path_b, group=dist.group.WORLD, block_rows=16)
    out = []
    a.put_state(1, ctr.state_dict(m), touched=tracker)  # first put: no base, all rows
    b.put_state(1, ctr.state_dict(m))
    for step, seeds in ((2, [20, 21]), (3, [22])):
        for s in seeds:
            trmodels.train_step(m, "ebc", trmodels.batch("ebc", s, 6, (400, 300, 200),
                                                         rank, world))
        if step == 3:  # a change that is no lookup, in a tensor the tracker does not cover
            with torch.no_grad():
                m.module.scale.add_(1.0)
        state = ctr.state_dict(m)
        if step == 3:  # a put that fails after reading the tracker: its ids must not be lost
            with pytest.raises(StepExists):
                a.put_state(2, state, touched=tracker)
            trmodels.train_step(m, "ebc", trmodels.batch("ebc", 23, 6, (400, 300, 200),
                                                         rank, world))
            state = ctr.state_dict(m)
        ia = a.put_state(step, state, touched=tracker)
        ib = b.put_state(step, state)
        out.append((ia.tables, ib.tables, ia.bytes_new, ib.bytes_new, ia.objects_new,
                    ib.objects_new))
    # the tracker is trusted for the tables it covers: a row changed by no lookup is not
    # seen through it (what makes it cheaper than fingerprinting every row)
    w = ctr.state_dict(m)["model"]["sparse.embedding_bags.t1.weight"]
    with torch.no_grad():
        for shard in w.local_shards():
            shard.tensor[0] += 1.0
    state = ctr.state_dict(m)
    out.append((a.put_state(4, state, touched=tracker).tables, b.put_state(4, state).tables))
    a.close()
    b.close()
    return out


def test_tracker_driven_puts_match_fingerprint_driven_ones(tmp_path):
    pytest.importorskip("torchrec")
    import trspawn

    got = trspawn.run(_tracker_worker, 2, str(tmp_path / "a"), str(tmp_path / "b"),
                      timeout=240)
    (t2a, _, *_), (t3a, t3b, *_), (t4a, t4b) = got[0]
    assert t3a["model/scale"] != t2a["model/scale"]  # found by its fingerprint
    t1 = "model/sparse.embedding_bags.t1.weight"
    assert t4a[t1] == t3a[t1] and t4b[t1] != t3b[t1]
    for ta, tb, na, nb, oa, ob in got[0][:2]:
        assert ta == tb  # the same tables, node for node: they restore identically
        assert 0 < na <= nb and 0 < oa <= ob

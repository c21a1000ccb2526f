"""DCP's save, async_save and load through cnrstore in one process (DCP's no_dist mode):
the state kinds DCP saves, a step that is an ordinary step, and errors raised inside
DCP's steps (modeled on torch's test/distributed/checkpoint/ suite: test_file_system_
checkpoint, test_save_load_api, the faulty storage layers of its error-handling tests)."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import cnrstore
from cnrstore.cli.app import main as cli
from cnrstore.dcp import StorageReader, StorageWriter
from cnrstore.tools.info import diff_steps, show_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning",
                                        "ignore::FutureWarning")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"emb.weight": torch.randn(1000, 16, generator=g),
                  "half": torch.randn(40, 8, generator=g).to(torch.bfloat16),
                  "ids": torch.randint(0, 1 << 40, (64,), generator=g),
                  "bias": torch.randn(16, generator=g)},
        "step": torch.tensor(seed),  # a 0-dim tensor
        "epoch": seed, "name": f"run {seed}", "sched": {"milestones": [3, 7], "gamma": 0.5},
        "nothing": None,
    }


def _blank(s):
    if isinstance(s, dict):
        return {k: _blank(v) for k, v in s.items()}
    if isinstance(s, torch.Tensor):
        return torch.zeros_like(s)
    return None


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_state_round_trips_tensors_and_python_values(tmp_path):
    path = str(tmp_path / "ckpt")
    s = _state(3)
    dcp.save(s, storage_writer=StorageWriter(path, step=7))
    target = _blank(s)
    dcp.load(target, storage_reader=StorageReader(path, step=None))
    assert _same(target, s)
    assert target["sched"] == {"milestones": [3, 7], "gamma": 0.5}


def test_a_dcp_step_is_an_ordinary_step(tmp_path):
    path, plain = str(tmp_path / "ckpt"), str(tmp_path / "plain")
    s = _state(1)
    w = StorageWriter(path, step=1, block_rows=128)
    dcp.save(s, storage_writer=w)
    tables = {"model.emb.weight": s["model"]["emb.weight"], "model.half": s["model"]["half"],
              "model.ids": s["model"]["ids"], "model.bias": s["model"]["bias"],
              "step": s["step"].reshape(1)}
    with cnrstore.open(plain, block_rows=128) as other:
        assert other.put_tables(1, tables).tables == w.info.tables  # the same blocks
        s["model"]["emb.weight"][[5, 500]] += 1.0
        w2 = StorageWriter(path, step=2)
        dcp.save(s, storage_writer=w2)
        put2 = other.put_tables(2, {**tables, "model.emb.weight": s["model"]["emb.weight"]})
    assert w2.info.tables == put2.tables
    assert w2.info.rows_changed["model.emb.weight"] == 2
    assert w2.info.bytes_written <= 0.25 * w.info.bytes_written
    with cnrstore.open(path) as store:
        got = store.get_tables(2, names=["model.emb.weight"], rows={"model.emb.weight":
                                                                    slice(490, 510)})
        assert torch.equal(got["model.emb.weight"], s["model"]["emb.weight"][490:510])
        d = diff_steps(store, 1, 2)
        changed = {t.name: t.row_ranges for t in d.tables if t.rows_changed}
        assert changed == {"model.emb.weight": ((5, 6), (500, 501))}, d
        assert store.verify().ok
        store.gc(keep_last=1)
        assert store.steps() == [2]
    assert cli(["verify", path]) == 0
    assert show_step(path, 2).metadata["dcp"]["tensors"]["step"][1] == []
    target = _blank(s)
    dcp.load(target, storage_reader=StorageReader(path))
    assert _same(target, s)


def test_an_open_store_keeps_its_diff_bases_and_stays_open(tmp_path):
    s = _state(2)
    with cnrstore.open(tmp_path / "ckpt") as store:
        dcp.save(s, storage_writer=StorageWriter(store, step=1))
        s["model"]["emb.weight"][7] = 0.0
        w = StorageWriter(store, step=2)
        dcp.save(s, storage_writer=w)
        assert w.info.rows_changed == {"model.emb.weight": 1, "model.half": 0, "model.ids": 0,
                                       "model.bias": 0, "step": 0}
        assert store.steps() == [1, 2]
        target = _blank(s)
        dcp.load(target, storage_reader=StorageReader(store, step=2))
        assert _same(target, s)


def test_optimizer_state_through_dcp_state_dict_helpers(tmp_path):
    def model_and_optim(lr):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        m(torch.arange(20)).sum().backward()
        opt.step()
        return m, opt

    m, opt = model_and_optim(0.1)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=StorageWriter(tmp_path, step=1))
    m2, opt2 = model_and_optim(0.5)
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    msd2, osd2 = get_state_dict(m2, opt2)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, storage_reader=StorageReader(tmp_path))
    set_state_dict(m2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert _same(m2.state_dict(), m.state_dict())
    a, b = opt.state_dict(), opt2.state_dict()
    assert b["param_groups"][0]["lr"] == 0.1
    assert all(_same(a["state"][k], b["state"][k]) for k in a["state"])


def test_async_save_returns_once_the_state_may_change(tmp_path):
    s = _state(4)
    want = s["model"]["emb.weight"].clone()
    fut = dcp.async_save(s, storage_writer=StorageWriter(tmp_path, step=1))
    s["model"]["emb.weight"].add_(1.0)
    fut.result()
    target = _blank(s)
    dcp.load(target, storage_reader=StorageReader(tmp_path, step=1))
    assert torch.equal(target["model"]["emb.weight"], want)


def test_quant_patterns_over_fqns(tmp_path):
    s = _state(5)
    dcp.save(s, storage_writer=StorageWriter(tmp_path, step=1, quant={"model.emb*": "int8"}))
    schemes = {t.name: t.scheme for t in show_step(str(tmp_path), 1).tables}
    assert schemes["model.emb.weight"] == "int8"
    assert {n for n, sc in schemes.items() if sc != "exact"} == {"model.emb.weight"}
    target = _blank(s)
    dcp.load(target, storage_reader=StorageReader(tmp_path))
    emb = s["model"]["emb.weight"]
    scale = (emb.amax(1) - emb.amin(1)) / 255
    err = (target["model"]["emb.weight"] - emb).abs().amax(1)
    assert bool((err <= scale * 0.51 + 1e-6).all())
    assert torch.equal(target["model"]["bias"], s["model"]["bias"])


# -- errors: DCP reports them, the store is left as it was ---------------------------------

def _steps(path) -> list[int]:
    with cnrstore.open(path) as store:  # also proves no handle was left open
        return store.steps()


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save(_state(1), storage_writer=StorageWriter(path, step=1))
    return path


class _Faulty(StorageWriter):
    def __init__(self, *a, where: str, **kw):
        super().__init__(*a, **kw)
        self.where = where

    def prepare_global_plan(self, plans):
        if self.where == "prepare_global_plan":
            raise ValueError("faulty prepare_global_plan")
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner):
        if self.where == "write_data":
            raise ValueError("faulty write_data")
        return super().write_data(plan, planner)


@pytest.mark.parametrize("where", ["prepare_global_plan", "write_data"])
def test_faulty_storage_layer(saved, where):
    with pytest.raises(CheckpointException, match=f"faulty {where}"):
        dcp.save(_state(2), storage_writer=_Faulty(saved, step=2, where=where))
    assert _steps(saved) == [1]


def test_save_errors_leave_the_store(saved):
    before = cnrstore.open(saved).get_tables(1)
    with pytest.raises(CheckpointException, match="StepExists|step 1 exists"):
        dcp.save(_state(9), storage_writer=StorageWriter(saved, step=1))
    with pytest.raises(CheckpointException, match="nomatch"):
        dcp.save(_state(9), storage_writer=StorageWriter(saved, step=2,
                                                          quant={"nomatch*": "int8"}))
    assert _steps(saved) == [1]
    with cnrstore.open(saved) as store:
        assert _same(store.get_tables(1), before)


def test_load_errors(saved, tmp_path):
    with pytest.raises(CheckpointException, match="step 4 not found"):
        dcp.load(_blank(_state(1)), storage_reader=StorageReader(saved, step=4))
    wrong = _blank(_state(1))
    wrong["model"]["emb.weight"] = torch.zeros(999, 16)
    with pytest.raises(CheckpointException, match="Size mismatch"):
        dcp.load(wrong, storage_reader=StorageReader(saved, step=1))
    missing = {"model": {"other": torch.zeros(3)}}
    with pytest.raises(CheckpointException, match="model.other"):
        dcp.load(missing, storage_reader=StorageReader(saved, step=1))
    assert _steps(saved) == [1]  # and every load closed the store it opened
    with cnrstore.open(tmp_path / "tables") as store:
        store.put_tables(1, {"t": torch.zeros(4, 2)})
    with pytest.raises(CheckpointException, match="not written through DCP"):
        dcp.load({"t": torch.zeros(4, 2)}, storage_reader=StorageReader(tmp_path / "tables"))
    with pytest.raises(CheckpointException, match="holds no step"):
        dcp.load({"t": torch.zeros(4, 2)}, storage_reader=StorageReader(tmp_path / "empty"))


def test_writers_travel_to_dcp_process_by_path(tmp_path):
    w = pickle.loads(pickle.dumps(StorageWriter(tmp_path, step=3, quant="int8")))
    assert (w.step, w.quant, w.target.path) == (3, "int8", str(tmp_path))
    with cnrstore.open(tmp_path) as store:
        with pytest.raises(cnrstore.InvalidInput, match="path"):
            pickle.dumps(StorageWriter(store, step=3))


def test_checkpoint_id_names_the_store(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(1), checkpoint_id=str(tmp_path / "b"),
                 storage_writer=StorageWriter(str(tmp_path / "a"), step=1))
    assert _steps(tmp_path / "b") == [1]
    assert not (tmp_path / "a").exists()


def test_cnrstore_errors_survive_pickling():
    # DCP gathers each rank's exception to the coordinator by pickling it: an error whose
    # constructor pickle could not call back broke the gather itself (TypeError in
    # torch's gather_object) instead of reaching the caller as DCP reports it.
    from cnrstore import errors as E

    cases = [E.WriteFailed(3, "disk full"), E.StepExists(4), E.StepNotFound(5),
             E.TableNotFound("t", 6), E.StepOrderError(1, 2), E.NonFiniteValues("t", 3, "int8"),
             E.RankFailed("gone", rank=1), E.CorruptData("bad", oid=b"\x01", pack="p"),
             E.BadPath("no", path="/x"), E.InvalidInput("plain")]
    for exc in cases:
        got = pickle.loads(pickle.dumps(exc))
        assert type(got) is type(exc) and str(got) == str(exc), (got, exc)
        assert vars(got) == vars(exc)

"""Every Python example of docs/GUIDE.md runs as written.

Each ```python block of the guide is found by its section and its place in that section,
and runs here in a fresh directory (the guide's relative paths, "ckpt/" and the like, land
there). An example names things the reader has (their tables, their model, their training
step); the setup of each block below makes those, small, and the store state the example
starts from. The only other change to an example's text maps the absolute paths it names
(/local/nvme/..., /lustre/...) into the test's directory; and each runs with cnrstore and
torch imported, as they are for a reader who goes through the guide from the top. A block
with no setup here fails the suite, so an example added to the guide is run from its first
commit on."""

from __future__ import annotations

import copy
import os
import pathlib
import re
import textwrap
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from _servers import moto_s3  # noqa: F401 - the fixture, registered by import
from torch import nn

import cnrstore

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "GUIDE.md"


@dataclass(frozen=True)
class Block:
    section: str
    n: int          # its place among the section's python blocks, from 0
    line: int       # 1-based line of its first code line
    code: str

    @property
    def key(self) -> str:
        return f"{self.section}#{self.n}"


def guide_blocks(text: str | None = None) -> list[Block]:
    lines = (GUIDE.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    section, counts, i = "", {}, 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"#{2,3} ", line):
            section = line.lstrip("#").strip()
        fence = re.match(r"(\s*)```python\s*$", line)
        if fence:
            body, start = [], i + 2
            i += 1
            while not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            n = counts.get(section, 0)
            counts[section] = n + 1
            blocks.append(Block(section, n, start, textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return blocks


# --- what the examples name -------------------------------------------------------------

def _tables(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"user": torch.randn(3000, 16, generator=g), "item": torch.randn(500, 8, generator=g)}


class DLRM(nn.Module):
    """The guide's model: embedding tables and an MLP (its arguments are the reader's)."""

    def __init__(self, *_args) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embs = nn.ModuleList([nn.EmbeddingBag(400, 8, mode="sum"),
                                   nn.EmbeddingBag(300, 8, mode="sum")])
        self.mlp = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = [emb(ids[:, k:k + 4]) for k, emb in enumerate(self.embs)]
        return self.mlp(torch.cat(pooled, dim=1)).squeeze(1)


class _Crash(Exception):
    """The training job dies (the guide's resume branch then has something to do)."""


def _trainer(crash_at: int | None) -> Callable[[nn.Module, torch.optim.Optimizer], None]:
    calls = [0]

    def train_one_epoch(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        if crash_at is not None and calls[0] == crash_at:
            raise _Crash
        calls[0] += 1
        for _ in range(2):
            # Data from the RNG, so a resume is exact only if the RNG state came back too.
            ids = torch.randint(0, 300, (32, 5))
            y = torch.rand(32)
            loss = nn.functional.binary_cross_entropy_with_logits(model(ids), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return train_one_epoch


def _run(block: Block, ns: dict, subs: dict[str, str] | None = None) -> dict:
    code = block.code
    for old, new in (subs or {}).items():
        code = code.replace(old, new)
    # A reader goes through the guide from the top: the imports of its first examples are
    # there for the later ones.
    ns.setdefault("__name__", "guide_example")
    ns.setdefault("cnrstore", cnrstore)
    ns.setdefault("torch", torch)
    try:
        exec(compile(code, f"{GUIDE}:{block.line}", "exec"), ns)
    finally:
        store = ns.get("store")
        if isinstance(store, cnrstore.CheckpointStore):
            store.close()   # as the reader's process exit would; closing twice is a no-op
    return ns


def _store_with(steps: dict[int, dict[str, torch.Tensor]], **opts) -> None:
    with cnrstore.open("ckpt/", **opts) as s:
        for step, tables in steps.items():
            s.put_tables(step, tables)


# --- one runner per example ---------------------------------------------------------------

def opening(block: Block, tmp: pathlib.Path, request) -> None:
    _run(block, {})
    assert (tmp / "ckpt").is_dir()
    with pytest.raises(cnrstore.CheckpointError):
        _run(block, {}, {'"ckpt/", create=False': '"nothing-here/", create=False'})


def on_s3(block: Block, tmp: pathlib.Path, request) -> None:
    pytest.importorskip("obstore")
    s3 = request.getfixturevalue("moto_s3")
    with _bucket_env(s3, "my-bucket"):
        _run(block, {"tables": _tables()}, {"/local/nvme/": f"{tmp}/local/nvme/"})
        with cnrstore.open("s3://my-bucket/runs/dlrm-7", cache_dir=tmp / "other-cache") as s:
            assert s.steps() == [7]
            assert torch.equal(s.get_tables(7)["user"], _tables()["user"])


class _bucket_env:
    def __init__(self, s3, bucket: str) -> None:
        from _s3 import make_bucket

        try:
            make_bucket(s3.endpoint, bucket)
        except Exception:  # made by an earlier example in this session
            pass
        self.env = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": "test",
                    "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        return self

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def putting(block: Block, tmp: pathlib.Path, request) -> None:
    t = _tables()
    ns = _run(block, {"store": cnrstore.open("ckpt/"), "t_user": t["user"], "t_item": t["item"]})
    assert ns["info"].step == 100 and set(ns["info"].rows_changed) == {"user", "item"}


def training_job(block: Block, tmp: pathlib.Path, request) -> None:
    # The job runs, is killed at epoch 37, and starts again as a new process would (fresh
    # model and optimizer, another RNG state): the guide's resume branch must bring back
    # what the last step stored (quantized embeddings, the optimizer's state, the RNG
    # state, the epoch) before training goes on, and the job then runs to its end.
    def job(crash_at: int | None, seen: dict | None = None) -> dict:
        train = _trainer(crash_at)

        def train_one_epoch(model, opt):
            if seen is not None and not seen:
                seen.update(model={k: v.clone() for k, v in model.state_dict().items()},
                            optim=copy.deepcopy(opt.state_dict()), rng=torch.get_rng_state())
            train(model, opt)

        return _run(block, {"DLRM": DLRM, "train_one_epoch": train_one_epoch})

    with pytest.raises(_Crash):
        job(37)
    with cnrstore.open("ckpt/") as s:
        assert s.steps()[-1] == 36
        stored = s.get_state(36)
    torch.manual_seed(2)
    seen: dict = {}
    again = job(None, seen)
    assert again["start"] == 37
    for name, value in stored["model"].items():
        assert torch.equal(seen["model"][name], value), name
    assert torch.equal(seen["rng"], stored["rng"])
    state, want = seen["optim"]["state"], stored["optim"]["state"]
    assert state and sorted(state) == sorted(want)
    for k in want:
        for name, value in want[k].items():
            assert torch.equal(state[k][name], value), (k, name)
    with cnrstore.open("ckpt/") as s:
        assert s.steps() == list(range(88, 100))


def resume_older(block: Block, tmp: pathlib.Path, request) -> None:
    model = DLRM()

    def state(epoch):
        return {"model": model.state_dict(), "epoch": epoch}

    with cnrstore.open("ckpt/") as s:
        for step in (100, 200, 300):
            with torch.no_grad():
                model.embs[0].weight.add_(1.0)
            s.put_state(step, state(step))
    _run(block, {"store": cnrstore.open("ckpt/"), "state": state})
    with cnrstore.open("ckpt/") as s:
        assert s.steps() == [100, 150]


def part_of_state(block: Block, tmp: pathlib.Path, request) -> None:
    model, trained = DLRM(), DLRM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def state(epoch):
        return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": epoch}

    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    topt = torch.optim.Adam(trained.parameters(), lr=1e-3)
    trained(torch.randint(0, 300, (4, 8))).sum().backward()
    topt.step()
    with cnrstore.open("ckpt/") as s:
        s.put_state(100, {"model": trained.state_dict(), "optim": topt.state_dict(),
                          "epoch": 7})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ns = _run(block, {"store": cnrstore.open("ckpt/"), "model": model, "state": state})
    assert sorted(ns["embs"]) == sorted(k for k in before if k.startswith("embs."))
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained.state_dict()[k]), k
    assert ns["restored"]["epoch"] == 7 and ns["restored"]["optim"]["state"] == {}
    assert not torch.equal(before["embs.0.weight"], model.embs[0].weight)


def training_loop(block: Block, tmp: pathlib.Path, request) -> None:
    # The loop is killed at step 555 and started again as a new process would (a fresh
    # model and a fresh Adam with no state): it must end with the weights and optimizer
    # state, bit for bit, of the same loop run without a stop in another directory.
    def train_step(crash_at: int | None) -> Callable:
        def step_fn(model, opt, step):
            if step == crash_at:
                raise _Crash
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 300, (16, 5), generator=g)
            y = torch.rand(16, generator=g)
            loss = nn.functional.binary_cross_entropy_with_logits(model(ids), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return float(loss)
        return step_fn

    with pytest.raises(_Crash):
        _run(block, {"DLRM": DLRM, "train_step": train_step(555)})
    again = _run(block, {"DLRM": DLRM, "train_step": train_step(None)})
    assert again["start"] == 501
    (tmp / "whole").mkdir()
    os.chdir(tmp / "whole")
    whole = _run(block, {"DLRM": DLRM, "train_step": train_step(None)})
    assert whole["start"] == 0
    for (name, a), b in zip(again["model"].state_dict().items(),
                            whole["model"].state_dict().values()):
        assert torch.equal(a, b), name
    sa, sb = again["opt"].state_dict(), whole["opt"].state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sorted(sa["state"]) == sorted(sb["state"])
    for k, st in sb["state"].items():
        for name, value in st.items():
            assert torch.equal(sa["state"][k][name], value), (k, name)
    with cnrstore.open(tmp / "whole" / "ckpt") as s:
        steps = s.steps()
        losses = {t: s.metadata(t)["metrics"]["loss"] for t in steps}
    kept = {0, 500, 700, 800, 900}
    saved = dict(losses)
    assert kept <= set(steps) and len(steps) <= len(kept) + 2, steps
    best = set(sorted(saved, key=saved.get)[:2])
    assert best <= set(steps)


def many_ranks(block: Block, tmp: pathlib.Path, request) -> None:
    from guide_worker import run_ranks

    results = run_ranks(2, block.code, {"ckpt/": f"{tmp}/ckpt/"}, cwd=str(tmp))
    for r in results:
        assert r == "ok", r
    with cnrstore.open(tmp / "ckpt") as s:   # the directory opens as a plain store
        assert s.steps() == [7, 8]


def many_ranks_storage(block: Block, tmp: pathlib.Path, request) -> None:
    pytest.importorskip("obstore")
    s3 = request.getfixturevalue("moto_s3")
    from guide_worker import run_ranks

    with _bucket_env(s3, "bucket") as env:
        subs = {"/lustre/": f"{tmp}/lustre/", "/local/nvme/": f"{tmp}/local/nvme/"}
        results = run_ranks(2, block.code, subs, cwd=str(tmp), env=env.env, prologue=(
            "import torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"))
    assert results == ["ok", "ok"], results
    assert (tmp / "lustre" / "ckpt" / "dlrm").is_dir()
    assert (tmp / "local" / "nvme" / "cnr-cache" / "dlrm-s3").is_dir()


def asynchronous(block: Block, tmp: pathlib.Path, request) -> None:
    ns = _run(block, {"store": cnrstore.open("ckpt/"), "step": 3, "tables": _tables()})
    assert ns["info"].step == 3


def restoring(block: Block, tmp: pathlib.Path, request) -> None:
    t = _tables()
    _store_with({100: t})
    model = nn.Module()
    model.user = nn.Embedding(3000, 16)
    ns = _run(block, {"store": cnrstore.open("ckpt/"), "model": model})
    assert torch.equal(model.user.weight.detach(), t["user"])
    assert torch.equal(ns["part"]["user"], t["user"][:1000])


def retention(block: Block, tmp: pathlib.Path, request) -> None:
    _store_with({s: _tables(s) for s in (0, 50, 60, 100)})
    ns = _run(block, {"store": cnrstore.open("ckpt/")})
    assert list(ns["report"].steps_kept) == [0, 50]


def verifying(block: Block, tmp: pathlib.Path, request) -> None:
    _store_with({0: _tables()})
    ns = _run(block, {"store": cnrstore.open("ckpt/")})
    assert ns["report"].ok


def inspecting(block: Block, tmp: pathlib.Path, request) -> None:
    _store_with({0: _tables(0), 1: _tables(1)})
    _run(block, {"store": cnrstore.open("ckpt/")})
    assert (tmp / "s1.safetensors").is_file()
    with cnrstore.open("ckpt/") as s:
        assert s.steps() == [0, 1, 9]
        assert torch.equal(s.get_tables(9)["user"], _tables(1)["user"])


def publishing(block: Block, tmp: pathlib.Path, request) -> None:
    _run(block, {})    # it checks its own replica


def publishing_file(block: Block, tmp: pathlib.Path, request) -> None:
    # The section's commands, then this plain-torch replay of the file they wrote onto a
    # replica of step 100, which must give step 120.
    import shlex

    from cnrstore.cli.app import main

    _store_with({100: _tables(0), 120: _tables(1)})
    section = GUIDE.read_text().split("## Publishing changes\n", 1)[1].split("\n## ", 1)[0]
    (commands,) = re.findall(r"```sh\n(.*?)```", section, re.S)
    for line in commands.strip().splitlines():
        argv = shlex.split(line)
        assert argv[0] == "cnrstore" and main(argv[1:]) == 0, line
    ns = _run(block, {})
    with cnrstore.open("ckpt/") as store:
        replica, want = store.get_tables(100), store.get_tables(120)
    ns["apply_changes_file"]("changes.safetensors", replica)
    assert sorted(replica) == sorted(want)
    assert all(torch.equal(replica[n], t) for n, t in want.items())
    from safetensors.torch import load_file

    back = load_file("replica.safetensors")     # --apply rewrote the replica as step 120
    assert sorted(back) == sorted(want) and all(torch.equal(back[n], want[n]) for n in want)


def from_dcp(block: Block, tmp: pathlib.Path, request) -> None:
    # One process (DCP's no_dist mode): the model is trained a little, saved twice, then
    # zeroed so that the load has something to bring back.
    model = DLRM()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _trainer(None)(model, optimizer)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = copy.deepcopy(optimizer.state_dict())

    import torch.distributed.checkpoint as dcp

    from cnrstore.tools.info import show_step

    real_load = dcp.load

    def load(state, **kw):  # the example's load, into a state zeroed first
        for t in list(state["model"].values()) + [v for st in state["optim"]["state"].values()
                                                  for v in st.values()]:
            t.detach().zero_()
        state["epoch"] = None
        return real_load(state, **kw)

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.setattr(dcp, "load", load)
        ns = _run(block, {"model": model, "optimizer": optimizer, "epoch": 3, "step": 10})
    assert ns["state"]["epoch"] == 3
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name
    got = optimizer.state_dict()["state"]
    for k, st in want_opt["state"].items():
        for n, v in st.items():
            assert torch.equal(got[k][n], v), (k, n)
    with cnrstore.open("ckpt/") as s:
        assert s.steps() == [10, 11]
        tables = s.get_tables(10)
        assert "model.embs.0.weight" in tables and "optim.state.mlp.0.weight.exp_avg" in tables
    stored = {t.name: t.scheme for t in show_step("ckpt/", 10).tables}
    assert stored["model.embs.0.weight"] == "int8" and stored["model.mlp.0.weight"] == "exact"


RUNNERS: dict[str, Callable] = {
    "Opening a store#0": opening,
    "Stores on S3#0": on_s3,
    "Putting a step#0": putting,
    "Checkpoint a training job#0": training_job,
    "Part of a state#0": part_of_state,
    "Resume from an older step#0": resume_older,
    "A training loop#0": training_loop,
    "Many ranks (torch.distributed)#0": many_ranks,
    "Many ranks (torch.distributed)#1": many_ranks_storage,
    "From DCP#0": from_dcp,
    "Asynchronous puts#0": asynchronous,
    "Restoring, whole or in part#0": restoring,
    "Retention and garbage collection#0": retention,
    "Integrity: verify and repair#0": verifying,
    "The command line#0": inspecting,
    "Publishing changes#0": publishing,
    "Publishing changes#1": publishing_file,
}


def test_every_guide_example_has_a_runner():
    keys = [b.key for b in guide_blocks()]
    assert len(keys) == len(set(keys))
    assert sorted(keys) == sorted(RUNNERS), (
        "docs/GUIDE.md's python blocks and tests/test_guide.py's RUNNERS differ: "
        f"unrun {sorted(set(keys) - set(RUNNERS))}, gone {sorted(set(RUNNERS) - set(keys))}")


def test_the_parser_finds_indented_blocks_by_section():
    text = ("## A\n```python\nx = 1\n```\n- item\n  ```python\n  y = 2\n  ```\n"
            "### B\n```python\nz\n```\n")
    got = [(b.key, b.code, b.line) for b in guide_blocks(text)]
    assert got == [("A#0", "x = 1\n", 3), ("A#1", "y = 2\n", 7), ("B#0", "z\n", 11)]


@pytest.mark.parametrize("block", guide_blocks(), ids=lambda b: b.key)
def test_guide_example_runs_as_written(block, tmp_path, monkeypatch, request):
    runner = RUNNERS.get(block.key)
    if runner is None:
        pytest.fail(f"no runner for {block.key} (docs/GUIDE.md line {block.line})")
    monkeypatch.chdir(tmp_path)
    runner(block, tmp_path, request)

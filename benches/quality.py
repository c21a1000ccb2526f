"""Model quality after restores from quantized checkpoints (Check-N-Run's accuracy question),
measured in paired runs fine enough to resolve its 0.01% budget.

For each task (benches/quality_tasks.py: the demo's synthetic CTR, MovieLens-100k) and seed,
the seed is trained once without restores (the base run) and once per (scheme, number of
restores) with them, on the same batches in the same order. A restore puts the whole
training state into a real store (embedding tables with the scheme; row accumulators and
the dense part exact), loads it back in place with ``load_state`` and trains on. Each
run's final held-out loss and AUC are compared with its own seed's base run, and the
per-seed relative changes are averaged with a 95% interval (benches/quality_report.py).
An exact restore must leave every table bit-identical to the base run: the experiment
stops if it does not, since the pairing would then be broken.

Runs of one seed share the base run's prefix: the base run keeps a copy of its state at
every restore point, and a run with restores starts from the copy at its first one (the
exact scheme checks that this forking changes nothing, too).

    .venv/bin/python benches/quality.py --jobs 2 --out docs/quality # the full experiment
    .venv/bin/python benches/quality.py --quick --out /tmp/q        # the smoke test (CI)
    .venv/bin/python benches/quality.py --report docs/quality       # tables and plots only
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from quality_report import report  # noqa: E402
from quality_tasks import TASKS, Task, make_task  # noqa: E402

import cnrstore  # noqa: E402
from cnrstore.demo.dlrm import DLRM, deterministic, evaluate, make_optimizer, train_step  # noqa: E402
from cnrstore.demo.driver import resolve_quant  # noqa: E402

SCHEMES = ("exact", "fp16", "int8", "int4")
RESTORES = (1, 5, 20)
SEEDS = 16
QUICK = {"seeds": 2, "schemes": ("exact", "int8", "int2"), "restores": (1, 3)}


class PairingBroken(AssertionError):
    """An exact restore changed the run: the paired comparison would measure noise."""


def restore_points(n: int, steps: int) -> list[int]:
    """``n`` distinct steps spread evenly over a run of ``steps``."""
    points = sorted({round((i + 1) * steps / (n + 1)) for i in range(n)})
    if len(points) != n or points[0] < 1 or points[-1] >= steps:
        raise ValueError(f"cannot place {n} restores in {steps} steps")
    return points


class _Run:
    """A model and its optimizer at some step of a task's training."""

    def __init__(self, task: Task, snapshot: tuple[int, dict, dict] | None = None) -> None:
        self.task = task
        self.model = DLRM(task.config)
        self.opt = make_optimizer(self.model, task.config)
        self.step = 0
        if snapshot is not None:
            self.step, model_state, opt_state = snapshot
            self.model.load_state_dict(model_state)
            self.opt.load_state_dict(opt_state)

    def train(self, until: int) -> None:
        config = self.task.config
        while self.step < until:
            scale = self.task.lr_scale(self.step)
            self.opt.lr, self.opt.dense_lr = config.lr * scale, config.dense_lr * scale
            train_step(self.model, self.opt, self.task.train.batch(self.step))
            self.step += 1

    def snapshot(self) -> tuple[int, dict, dict]:
        return (self.step, copy.deepcopy(self.model.state_dict()),
                copy.deepcopy(self.opt.state_dict()))

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def restore(self, store, scheme: str, expected_restores: int) -> int:
        """Put the state into ``store`` with ``scheme``, load it back in place; bytes written."""
        quant = resolve_quant(scheme, self.task.config, expected_restores=expected_restores)
        info = store.put_state(self.step, self.state(), quant=quant)
        restored = store.load_state(self.step, self.state())
        self.opt.load_state_dict(restored["optim"])  # its Python values (lr, eps)
        return info.bytes_written

    def tables(self) -> dict[str, torch.Tensor]:
        from cnrstore.core.state import flatten

        return flatten(self.state()).tables


def run_seed(task: Task, *, schemes=SCHEMES, restores=RESTORES, workdir: Path) -> dict:
    """The base run and one run per (restores, scheme) of one seed of ``task``."""
    t0 = time.perf_counter()
    plans = {n: restore_points(n, task.steps) for n in restores}
    forks = sorted({pts[0] for pts in plans.values()})
    base, snaps = _Run(task), {}
    for point in forks:
        base.train(point)
        snaps[point] = base.snapshot()
    base.train(task.steps)
    base_loss, base_auc = evaluate(base.model, task.eval)
    base_tables = base.tables()
    runs = []
    for n, points in plans.items():
        for scheme in schemes:
            run, written = _Run(task, snaps[points[0]]), []
            where = Path(tempfile.mkdtemp(prefix=f"{scheme}-{n}-", dir=workdir))
            store = cnrstore.open(where)
            try:
                for point in points:
                    run.train(point)
                    written.append(run.restore(store, scheme, n))
            finally:
                store.close()
                shutil.rmtree(where, ignore_errors=True)
            run.train(task.steps)
            loss, auc = evaluate(run.model, task.eval)
            same = all(torch.equal(t, base_tables[k]) for k, t in run.tables().items())
            if scheme == "exact" and not (same and (loss, auc) == (base_loss, base_auc)):
                raise PairingBroken(f"{task.name} seed {task.config.seed}: {n} exact restores "
                                    f"changed the run (loss {loss!r} vs {base_loss!r})")
            runs.append({"scheme": scheme, "restores": n, "loss": loss, "auc": auc,
                         "bytes": written[0], "identical": same})
    return {"seed": task.config.seed, "loss": base_loss, "auc": base_auc, "runs": runs,
            "seconds": round(time.perf_counter() - t0, 1)}


def _header(task: Task) -> dict:
    return {"steps": task.steps, "eval_samples": task.eval_samples,
            "batch": task.config.batch_size, "dim": task.config.dim,
            "table_rows": list(task.config.table_rows), "lr": task.config.lr,
            "dense_lr": task.config.dense_lr, "anneal": task.anneal, "seeds": []}


def _one_seed(job: tuple) -> tuple[str, dict, dict]:
    """One (task, seed) of the experiment, in this process (a worker of ``--jobs``)."""
    name, seed, quick, schemes, restores = job
    with deterministic(), tempfile.TemporaryDirectory(prefix="cnrstore-quality-") as tmp:
        task = make_task(name, seed, quick=quick)
        return name, _header(task), run_seed(task, schemes=schemes, restores=restores,
                                             workdir=Path(tmp))


def experiment(tasks, *, seeds: int, schemes=SCHEMES, restores=RESTORES, quick=False,
               out: Path | None = None, jobs: int = 1, first_seed: int = 0,
               log=print) -> dict:
    """Every seed of every task; with ``out``, results.json is rewritten after each seed,
    so an interrupted run keeps what it finished (``first_seed`` goes on from there; merge
    the two with ``--report``). ``jobs`` > 1 runs that many seeds at once in worker
    processes (each single-threaded, so the figures do not depend on it)."""
    doc: dict = {"schemes": list(schemes), "restores": list(restores), "quick": quick,
                 "tasks": {}}
    work = [(name, seed, quick, tuple(schemes), tuple(restores))
            for seed in range(first_seed, seeds) for name in tasks]  # seeds outermost: a cut-short
    pool = None                                          # run has all tasks
    if jobs > 1:
        pool = multiprocessing.get_context("spawn").Pool(jobs, maxtasksperchild=1)
        done = pool.imap(_one_seed, work)
    else:
        done = map(_one_seed, work)
    try:
        for name, header, result in done:
            entry = doc["tasks"].setdefault(name, header)
            entry["seeds"].append(result)
            log(f"{name} seed {result['seed']}: base loss {result['loss']:.6f} auc "
                f"{result['auc']:.6f} ({result['seconds']}s)")
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                (out / "results.json").write_text(json.dumps(doc, indent=1))
    finally:
        if pool is not None:
            pool.terminate()
    return doc


def plateau(name: str, seed: int = 0, *, quick: bool = False, log=print) -> list[dict]:
    """How close a task's base run ends to its plateau: held-out loss and AUC after every
    tenth of the run, and at the end of a run twice as long (its learning rates decayed
    over twice the steps). ``last_tenth``: the relative change of the held-out loss over
    the last 10% of the run."""
    rows = []
    with deterministic():
        for factor in (1, 2):
            task = make_task(name, seed, quick=quick)
            task = replace(task, steps=task.steps * factor)
            run, curve = _Run(task), []
            marks = [task.steps * k // 10 for k in range(1, 11)] if factor == 1 else [task.steps]
            for mark in marks:
                run.train(mark)
                loss, auc = evaluate(run.model, task.eval)
                curve.append(loss)
                rows.append({"task": name, "steps": mark, "of": task.steps, "loss": loss,
                             "auc": auc})
                log(f"{name} seed {seed}: step {mark} of {task.steps}: loss {loss:.6f} "
                    f"auc {auc:.6f}")
            if factor == 1:
                rows[-1]["last_tenth"] = (curve[-1] - curve[-2]) / curve[-2]
                log(f"{name} seed {seed}: the last tenth changes the loss by "
                    f"{rows[-1]['last_tenth']:+.2e}")
    return rows


def _outcome(run: dict) -> dict:
    # A store's bytes for the same state vary by a few bytes between processes (its
    # commit metadata); the quality a run reaches does not.
    return {k: v for k, v in run.items() if k != "bytes"}


def merge(docs: list[dict]) -> dict:
    """One results document from several runs (e.g. one per task, or more schemes for the
    same seeds). Runs of the same task and seed are joined: their base runs must be the
    same (same setup, deterministic training), and a cell measured twice must reach the
    same loss and AUC."""
    doc = copy.deepcopy(docs[0])
    for other in docs[1:]:
        if other["quick"] != doc["quick"]:
            raise ValueError("results of the quick mode and of the full run do not merge")
        for name, task in other["tasks"].items():
            mine = doc["tasks"].setdefault(name, copy.deepcopy({**task, "seeds": []}))
            if any(mine[k] != v for k, v in task.items() if k != "seeds" and k in mine):
                raise ValueError(f"{name}: the runs to merge differ in setup")
            seeds = {s["seed"]: s for s in mine["seeds"]}
            for seed in task["seeds"]:
                have = seeds.get(seed["seed"])
                if have is None:
                    mine["seeds"].append(copy.deepcopy(seed))
                    continue
                if (have["loss"], have["auc"]) != (seed["loss"], seed["auc"]):
                    raise ValueError(f"{name} seed {seed['seed']}: base runs differ")
                runs = {(r["scheme"], r["restores"]): r for r in have["runs"]}
                for run in seed["runs"]:
                    key = (run["scheme"], run["restores"])
                    if key in runs and _outcome(runs[key]) != _outcome(run):
                        raise ValueError(f"{name} seed {seed['seed']}: {key} differs")
                    if key not in runs:
                        have["runs"].append(copy.deepcopy(run))
                if "seconds" in seed:
                    have["seconds"] = have.get("seconds", 0) + seed["seconds"]
            mine["seeds"].sort(key=lambda s: s["seed"])
        order = list(SCHEMES) + [s for s in doc["schemes"] + other["schemes"]
                                 if s not in SCHEMES]
        doc["schemes"] = [s for s in dict.fromkeys(order)
                          if s in doc["schemes"] or s in other["schemes"]]
        doc["restores"] = sorted(set(doc["restores"]) | set(other["restores"]))
        if "wall_s" in other:
            doc["wall_s"] = doc.get("wall_s", 0) + other["wall_s"]
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: short training, {QUICK['seeds']} seeds, "
                        f"schemes {' '.join(QUICK['schemes'])}")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--seeds", type=int, help=f"seeds per task (default {SEEDS})")
    parser.add_argument("--first-seed", type=int, default=0, help="skip the seeds below "
                        "this one (to finish a cut-short run; merge them with --report)")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES)
    parser.add_argument("--restores", type=int, nargs="+")
    parser.add_argument("--jobs", type=int, default=1,
                        help="seeds run at once, in worker processes (the machine's cores)")
    parser.add_argument("--out", type=Path, help="write results.json, the plots and "
                        "report.md into this folder")
    parser.add_argument("--report", type=Path, nargs="+", metavar="DIR",
                        help="run nothing: tables and plots from DIR/results.json (several: "
                        "their tasks together, e.g. of one run per task; written to --out "
                        "or the first DIR)")
    parser.add_argument("--plateau", action="store_true",
                        help="run nothing else: each task's held-out loss (seed 0) after "
                        "every tenth of its run, and after a run twice as long")
    args = parser.parse_args(argv)
    if args.plateau:
        rows = [r for name in args.tasks for r in plateau(name, quick=args.quick)]
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "plateau.json").write_text(json.dumps(rows, indent=1))
        return 0
    if args.report:
        doc = merge([json.loads((d / "results.json").read_text()) for d in args.report])
        out = args.out or args.report[0]
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(doc, indent=1))
        print(report(doc, out))
        return 0
    t0 = time.perf_counter()
    doc = experiment(args.tasks, seeds=args.seeds or (QUICK["seeds"] if args.quick else SEEDS),
                     schemes=tuple(args.schemes or (QUICK["schemes"] if args.quick else SCHEMES)),
                     restores=tuple(args.restores or (QUICK["restores"] if args.quick
                                                      else RESTORES)),
                     quick=args.quick, out=args.out, jobs=args.jobs,
                     first_seed=args.first_seed,
                     log=lambda s: print(s, flush=True))
    doc["wall_s"] = round(time.perf_counter() - t0)
    if args.out is not None:
        (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    print(report(doc, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Model quality after restores from quantized checkpoints (Check-N-Run's accuracy question).

Trains the demo's DLRM (cnrstore.demo.dlrm) on its synthetic click-through task. For each
number of simulated failures and each scheme, a run checkpoints every ``--every`` steps
into a real store with that scheme (embedding tables quantized; row accumulators and the
dense part exact), and at each failure point drops the model, the optimizer and the store
handle, reopens the store, restores the latest step and trains on. Every run sees the same
batches in the same order, so its final eval loss and AUC differ from the uninterrupted
run's only through what the restores changed. Exact restores must reproduce the
uninterrupted run bit for bit.

    .venv/bin/python benches/quality.py                 # the table of docs/QUALITY.md
    .venv/bin/python benches/quality.py --write docs/QUALITY.md --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cnrstore  # noqa: E402
from cnrstore.demo.dlrm import DLRMConfig, Trainer, deterministic, evaluate  # noqa: E402
from cnrstore.demo.driver import resolve_quant  # noqa: E402

SCHEMES = ("exact", "fp16", "int8", "int4", "int3", "int2", "auto")
RESTORES = (1, 5, 20)
BUDGET = 1e-4  # Check-N-Run: accuracy may drop by less than 0.01% (relative)


@dataclass(frozen=True)
class Outcome:
    scheme: str         # as asked ("auto" stays "auto")
    resolved: str       # the scheme the embedding tables were stored with
    restores: int
    loss: float
    auc: float
    mean_bytes: float   # bytes written per incremental checkpoint
    seconds: float

    def loss_rel(self, base: Outcome) -> float:
        """Relative loss increase over ``base`` (positive: worse)."""
        return (self.loss - base.loss) / base.loss

    def auc_rel(self, base: Outcome) -> float:
        """Relative AUC drop from ``base`` (positive: worse)."""
        return (base.auc - self.auc) / base.auc

    def within(self, base: Outcome, budget: float = BUDGET) -> bool:
        return self.loss_rel(base) < budget and self.auc_rel(base) < budget


def failure_points(n: int, *, steps: int, every: int) -> list[int]:
    """``n`` distinct steps spread over the run, none on a checkpoint (work is lost)."""
    if n < 0 or n >= steps:
        raise ValueError(f"cannot place {n} failures in {steps} steps")
    points = []
    for i in range(n):
        f = max(1, (i + 1) * steps // (n + 1))
        if f % every == 0:
            f = f + 1 if f + 1 < steps else f - 1
        points.append(f)
    if len(set(points)) != n:
        raise ValueError(f"{n} failures do not fit in {steps} steps at every={every}")
    return points


def run_case(config: DLRMConfig, *, steps: int, every: int, failures: list[int],
             scheme: str, workdir: Path, n_eval: int = 32, device: str = "cpu",
             keep_tables: bool = False) -> tuple[Outcome, dict[str, torch.Tensor] | None]:
    """Train to ``steps``, failing and restoring at each of ``failures``; evaluate."""
    quant = resolve_quant(scheme, config, expected_restores=max(1, len(failures)))
    resolved = quant if isinstance(quant, str) else next(iter(quant.values()))
    written: list[int] = []
    t0 = time.perf_counter()
    with deterministic():
        store = cnrstore.open(workdir) if failures else None
        trainer = Trainer(config, store=store, every=every, quant=quant, device=device,
                          on_checkpoint=lambda info, _stall: written.append(info.bytes_written))
        if store is not None:
            trainer.checkpoint()
        for point in failures:
            trainer.run(point)
            trainer.wait()
            # The failure: model, optimizer and store handle are gone; a new job reopens.
            store.close()
            del trainer
            store = cnrstore.open(workdir)
            trainer = Trainer(config, store=store, every=every, quant=quant, device=device,
                              on_checkpoint=lambda info, _s: written.append(info.bytes_written))
            trainer.restore_latest()
        trainer.run(steps)
        if store is not None:
            trainer.wait()
            store.close()
        loss, auc = evaluate(trainer.model, trainer.data.eval_batches(n_eval))
        tables = ({k: v.cpu().clone() for k, v in trainer.tables().items()}
                  if keep_tables else None)
    incremental = written[1:]  # the first checkpoint (step 0) is a full one
    outcome = Outcome(scheme, resolved, len(failures), loss, auc,
                      sum(incremental) / max(1, len(incremental)), time.perf_counter() - t0)
    return outcome, tables


def experiment(config: DLRMConfig, *, steps: int, every: int, restores=RESTORES,
               schemes=SCHEMES, n_eval: int = 32, device: str = "cpu",
               log=None) -> tuple[Outcome, list[Outcome]]:
    """The uninterrupted run and one run per (restores, scheme).

    "auto" resolves to one of the other schemes; when that scheme is also measured, its
    run is reused (the two runs would be identical)."""
    with tempfile.TemporaryDirectory(prefix="cnrstore-quality-") as tmp:
        base, _ = run_case(config, steps=steps, every=every, failures=[], scheme="exact",
                           workdir=Path(tmp) / "base", n_eval=n_eval, device=device)
        if log:
            log(f"uninterrupted: loss {base.loss:.6f} auc {base.auc:.6f} ({base.seconds:.1f}s)")
        out: list[Outcome] = []
        for n in restores:
            points = failure_points(n, steps=steps, every=every)
            done: dict[str, Outcome] = {}
            for scheme in sorted(schemes, key=lambda s: s == "auto"):
                quant = resolve_quant(scheme, config, expected_restores=n)
                resolved = quant if isinstance(quant, str) else next(iter(quant.values()))
                if resolved in done:
                    o = replace(done[resolved], scheme=scheme)
                else:
                    o, _ = run_case(config, steps=steps, every=every, failures=points,
                                    scheme=scheme, workdir=Path(tmp) / f"{scheme}-{n}",
                                    n_eval=n_eval, device=device)
                    done[resolved] = o
                out.append(o)
                if log:
                    log(f"{n:>3} restores {scheme:>5} ({o.resolved}): loss {o.loss:.6f} "
                        f"({o.loss_rel(base):+.2e}) auc {o.auc:.6f} ({-o.auc_rel(base):+.2e}) "
                        f"{o.seconds:.1f}s")
    return base, out


def markdown(runs: list[tuple[Outcome, list[Outcome]]], params: dict) -> str:
    """One row per scheme, one column per restore count: relative loss increase and AUC
    change against the uninterrupted run, averaged over the runs (seeds) given."""
    restores = sorted({o.restores for _, outs in runs for o in outs})
    schemes = list(dict.fromkeys(o.scheme for _, outs in runs for o in outs))
    cells: dict[tuple[str, int], list[tuple[Outcome, Outcome]]] = {}
    for base, outs in runs:
        for o in outs:
            cells.setdefault((o.scheme, o.restores), []).append((base, o))
    head = "| scheme | bytes/ckpt | " + " | ".join(
        f"{n} restore{'s' * (n > 1)}: loss / AUC" for n in restores) + " |"
    lines = [head, "|" + "---|" * (2 + len(restores))]
    for s in schemes:
        first = cells[(s, restores[0])]
        row = [s, f"{sum(o.mean_bytes for _, o in first) / len(first) / 1e3:,.0f} kB"]
        for n in restores:
            pairs = cells.get((s, n), [])
            if not pairs:
                row.append("")
                continue
            loss = sum(o.loss_rel(b) for b, o in pairs) / len(pairs)
            auc = -sum(o.auc_rel(b) for b, o in pairs) / len(pairs)
            mark = "" if loss < BUDGET and -auc < BUDGET else " ✗"
            names = sorted({o.resolved for _, o in pairs})
            name = f" [{'/'.join(names)}]" if s == "auto" else ""
            row.append(f"{loss:+.1e} / {auc:+.1e}{mark}{name}")
        lines.append("| " + " | ".join(row) + " |")
    bases = ", ".join(f"{b.loss:.6f} / {b.auc:.6f}" for b, _ in runs)
    lines += ["", f"Uninterrupted run(s), eval loss / AUC: {bases}.",
              "Parameters: " + ", ".join(f"{k}={v}" for k, v in params.items()) + "."]
    return "\n".join(lines)


def _load(path: str) -> tuple[tuple[Outcome, list[Outcome]], dict]:
    doc = json.loads(Path(path).read_text())
    return (Outcome(**doc["base"]), [Outcome(**o) for o in doc["outcomes"]]), doc["params"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--scale", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restores", type=int, nargs="+", default=list(RESTORES))
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--json", metavar="PATH", help="write the outcomes as JSON")
    parser.add_argument("--report", nargs="+", metavar="JSON",
                        help="run nothing: print the table averaged over these JSON outputs")
    args = parser.parse_args(argv)
    if args.report:
        loaded = [_load(p) for p in args.report]
        params = {**loaded[0][1], "seeds": [p["seed"] for _, p in loaded]}
        params.pop("seed", None)
        print(markdown([r for r, _ in loaded], params))
        return 0
    config = DLRMConfig(seed=args.seed).scaled(args.scale)
    t0 = time.perf_counter()
    base, outcomes = experiment(config, steps=args.steps, every=args.every,
                                restores=args.restores, schemes=args.schemes,
                                device=args.device, log=lambda s: print(s, flush=True))
    params = {"steps": args.steps, "every": args.every, "scale": args.scale,
              "seed": args.seed, "table_rows": config.table_rows, "dim": config.dim,
              "batch": config.batch_size, "device": args.device,
              "eval_samples": 32 * config.batch_size, "wall_s": round(time.perf_counter() - t0)}
    print(markdown([(base, outcomes)], params))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"params": params, "base": asdict(base),
             "outcomes": [asdict(o) for o in outcomes]}, indent=2, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())

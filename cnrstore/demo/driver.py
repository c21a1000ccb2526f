"""``python -m cnrstore.demo.driver``: train a small DLRM, checkpoint it, kill it, resume it.

The demo runs the trainer (cnrstore.demo.dlrm) in a subprocess that checkpoints every
``--every`` steps with non-blocking puts, SIGKILLs it at ``--fail-at`` (a put may be in
flight), starts a new process that restores the latest step and finishes, then compares
with an uninterrupted run in this process (same seed, same data order) and with a full
``torch.save`` of the same state, runs gc, and prints one table.

The trainer process talks to this one in JSON lines on its stdout; at ``--fail-at`` it
waits on stdin until it is killed, so the kill lands at a known step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from fnmatch import fnmatchcase
from pathlib import Path

import torch

from cnrstore.demo import serving
from cnrstore.demo.dlrm import (
    DLRMConfig,
    SyntheticCTR,
    Trainer,
    deterministic,
    evaluate,
    teacher_floor,
)
from cnrstore.tools.info import disk_bytes
from cnrstore.tools.progress import Progress

__all__ = ["add_arguments", "main", "resolve_quant"]

SCHEMES = ("exact", "fp16", "bf16", "int8", "int4", "int3", "int2", "auto")
EVAL_BATCHES = 16
EMBEDDINGS = "model/embs.*.weight"   # the embedding tables among the state's tables


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (the CLI's ``demo`` subcommand uses this too)."""
    parser.add_argument("--store", metavar="PATH",
                        help="store directory, kept afterwards (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the table sizes (default 1.0: 225k rows in 5 tables)")
    parser.add_argument("--every", type=int, default=25,
                        help="checkpoint every N steps (default 25)")
    parser.add_argument("--scheme", choices=SCHEMES, default="exact",
                        help="quantization of the embedding tables (default exact; optimizer "
                        "and dense state are always exact)")
    parser.add_argument("--fail-at", type=int, metavar="STEP",
                        help="step at which the trainer is SIGKILLed (default: ~60%% through)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data and model")
    parser.add_argument("--optimizer", choices=("adagrad", "rowwise"), default="adagrad",
                        help="torch.optim.Adagrad (default) or row-wise Adagrad")
    parser.add_argument("--device", default="cpu",
                        help="where the model trains: cpu (default) or cuda")
    parser.add_argument("--publish-every", type=int, default=1, metavar="N",
                        help="publish every N-th kept step to a serving copy by "
                        "store.changes and check it against the store (default 1; 0: no "
                        "serving copy)")
    parser.add_argument("--quiet", action="store_true", help="print only the final table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


class _Failed(Exception):
    """A bad option or a trainer that did not behave: one line on stderr, no traceback."""

    def __init__(self, message: str, *, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _check(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise _Failed("--steps must be >= 1")
    if args.every < 1:
        raise _Failed("--every must be >= 1")
    if not args.scale > 0:
        raise _Failed("--scale must be > 0")
    if getattr(args, "publish_every", 0) < 0:
        raise _Failed("--publish-every must be >= 0")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise _Failed(f"--device must be cpu or cuda[:N]; got {args.device!r}")
    if args.device != "cpu" and not torch.cuda.is_available():
        raise _Failed(f"--device {args.device}: CUDA is not available")
    if args.fail_at is None:
        # Mid-interval, so the kill loses work that the resumed run must redo.
        args.fail_at = max(1, int(args.steps * 0.6) // args.every * args.every + args.every // 2)
    if not 0 < args.fail_at < args.steps and not args.worker:  # workers get steps+1: no kill
        raise _Failed(f"--fail-at must be in 1..{args.steps - 1}")


def resolve_quant(scheme: str, config: DLRMConfig, *,
                  expected_restores: int) -> str | dict[str, str]:
    """The ``quant=`` of a put: ``scheme`` for the embedding tables, exact for the rest.

    The optimizer state and the dense part steer every later update, so quantizing them
    costs accuracy; a pattern picks the embedding weights (``model/embs.<k>.weight``).
    "auto" asks the store's policy for a scheme given how many restores the job expects.
    """
    if scheme == "auto":
        try:
            from cnrstore.codec.autopolicy import auto_scheme
        except ImportError as exc:
            raise ValueError("scheme 'auto' needs cnrstore.codec.autopolicy.auto_scheme") from exc
        scheme = auto_scheme(expected_restores)
    if scheme == "exact":
        return "exact"
    return {EMBEDDINGS: scheme}


def _config(args: argparse.Namespace) -> DLRMConfig:
    return DLRMConfig(seed=args.seed, optimizer=args.optimizer).scaled(args.scale)


# -- the trainer process ---------------------------------------------------------------


def _emit(**event: object) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _embedding_rows(rows_changed: dict[str, int]) -> int:
    # Rows of the embedding tables only: their optimizer state changes with them, and the
    # dense tables' "rows" are matrix rows, which would muddle the count.
    return sum(n for name, n in rows_changed.items() if fnmatchcase(name, EMBEDDINGS))


def _worker(args: argparse.Namespace) -> int:
    import cnrstore

    config = _config(args)
    with deterministic(), cnrstore.open(args.store) as store:
        trainer = Trainer(
            config, store=store, every=args.every, device=args.device,
            quant=resolve_quant(args.scheme, config, expected_restores=1),
            on_checkpoint=lambda info, stall: _emit(
                ckpt=info.step, bytes=info.bytes_written, stall=stall,
                rows=_embedding_rows(info.rows_changed), logical=info.logical_bytes))
        if store.steps():
            t0 = time.perf_counter()
            step = trainer.restore_latest()
            _emit(restored=step, seconds=time.perf_counter() - t0)
        else:
            trainer.checkpoint()

        def on_step(step: int, loss: float) -> None:
            _emit(step=step, loss=loss)
            if step == args.fail_at:
                _emit(waiting_for_kill=step)
                sys.stdin.readline()  # the parent SIGKILLs us here

        trainer.run(args.steps, checkpoint_last=True, on_step=on_step)
        trainer.wait()
        loss, auc = evaluate(trainer.model, trainer.data.eval_batches(EVAL_BATCHES))
        _emit(final_loss=loss, final_auc=auc)
    return 0


# -- the driver ------------------------------------------------------------------------


def _bar(label: str, total: int, show: bool) -> Progress:
    # keep=True: each run's last line (its final loss) stays on screen.
    return Progress(f"{label:<9}", total=total, enabled=show, keep=True)


def _spawn(args: argparse.Namespace, *, kill_at: int | None, events: list[dict],
           bar: Progress) -> int:
    cmd = [sys.executable, "-m", "cnrstore.demo.driver", "--worker", "--store", args.store,
           "--steps", str(args.steps), "--scale", str(args.scale), "--every", str(args.every),
           "--scheme", args.scheme, "--seed", str(args.seed), "--device", args.device,
           "--optimizer", args.optimizer,
           "--fail-at", str(kill_at if kill_at is not None else args.steps + 1)]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        event = json.loads(line)
        events.append(event)
        if "step" in event:
            bar.update(event["step"], f"loss {event['loss']:.4f}")
        if "waiting_for_kill" in event:
            proc.send_signal(signal.SIGKILL)
    bar.close()
    return proc.wait()


def _reference(args: argparse.Namespace, bar: Progress) -> tuple[float, float, int, float]:
    """The uninterrupted run: (eval loss, AUC, torch.save bytes, torch.save seconds)."""
    config = _config(args)
    with deterministic():
        trainer = Trainer(config, store=None, every=args.every, quant="exact",
                          device=args.device)
        trainer.run(args.steps, on_step=lambda s, loss: bar.update(s, f"loss {loss:.4f}"))
        bar.close()
        loss, auc = evaluate(trainer.model, trainer.data.eval_batches(EVAL_BATCHES))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "full.pt"
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(trainer.state(), f)  # from the device, as a user's save would
                f.flush()
                os.fsync(f.fileno())
            seconds = time.perf_counter() - t0
            size = path.stat().st_size
    return loss, auc, size, seconds


def _mb(n: float) -> str:
    return f"{n / 1e6:8.2f} MB"


def _report(args, run1, run2, ref, gc_line, floor, store_bytes) -> str:
    loss_ref, auc_ref, save_bytes, save_s = ref
    restored = next(e for e in run2 if "restored" in e)
    final = next(e for e in run2 if "final_loss" in e)
    ckpts = [e for e in run1 + run2 if "ckpt" in e]
    done = {e["ckpt"] for e in run1 if "ckpt" in e}  # committed before the kill
    lost = sorted({e["step"] for e in run1 if "step" in e and e["step"] % args.every == 0}
                  - done - {restored["restored"]})
    rows = [f"cnrstore demo: {len(_config(args).table_rows)} tables, "
            f"{sum(_config(args).table_rows):,} rows, {args.steps} steps, checkpoint every "
            f"{args.every}, scheme {args.scheme}, killed at step {args.fail_at}",
            "",
            f"{'step':>6} {'emb rows chg':>13} {'written':>12} {'torch.save':>12} "
            f"{'ratio':>7} {'stall ms':>9}"]
    # A checkpoint the kill came before is a row too: either its put committed but the
    # killed trainer never printed it (the resumed process restored it), or it was still
    # in flight and is absent from the store. Leaving it out read as a step never taken.
    unreported = {restored["restored"]} - done - {e["ckpt"] for e in ckpts}
    marks = {s: "committed; its report died with the killed trainer" for s in unreported}
    marks.update({s: "lost in flight: the kill came before its commit" for s in lost})
    for e in sorted(ckpts + [{"ckpt": s} for s in marks], key=lambda e: e["ckpt"]):
        if "rows" not in e:
            rows.append(f"{e['ckpt']:>6}   ({marks[e['ckpt']]})")
            continue
        by = "resumed" if any(e is r for r in run2) else ""
        rows.append(f"{e['ckpt']:>6} {e['rows']:>13,} {_mb(e['bytes']):>12} "
                    f"{_mb(save_bytes):>12} {save_bytes / max(1, e['bytes']):>6.1f}x "
                    f"{e['stall'] * 1e3:>9.1f}  {by}".rstrip())
    incr = [e for e in ckpts if e["ckpt"] != 0]  # step 0 is the one full put
    if incr:
        mean_bytes = sum(e["bytes"] for e in incr) / len(incr)
        mean_stall = sum(e["stall"] for e in incr) / len(incr)
        rows.append(f"{'mean':>6} {'(incremental)':>13} {_mb(mean_bytes):>12} "
                    f"{_mb(save_bytes):>12} {save_bytes / max(1, mean_bytes):>6.1f}x "
                    f"{mean_stall * 1e3:>9.1f}")
    same = final["final_loss"] == loss_ref
    rows += [
        "",
        f"full torch.save of the same state: {_mb(save_bytes).strip()}, "
        f"{save_s * 1e3:.0f} ms blocking (fsync'ed)",
        f"killed at step {args.fail_at}" + (f" (checkpoints lost in flight: {lost})"
                                            if lost else "")
        + f"; restored step {restored['restored']} in {restored['seconds'] * 1e3:.0f} ms",
        f"final eval loss: resumed {final['final_loss']:.6f}, uninterrupted {loss_ref:.6f} "
        + ("(bit-identical)" if same else
           f"(relative diff {(final['final_loss'] - loss_ref) / loss_ref:+.2e})"),
        f"final eval AUC:  resumed {final['final_auc']:.6f}, uninterrupted {auc_ref:.6f}; "
        f"teacher's own loss (floor) {floor:.6f}",
        gc_line,
        f"store on disk: {_mb(store_bytes).strip()} at {args.store}"
        + (" (temporary: removed now; keep one with --store PATH)" if args.temporary else ""),
    ]
    return "\n".join(rows)


def main(argv: list[str] | argparse.Namespace | None = None) -> int:
    """Run the demo; returns the exit code (0 ok, 1 the run failed, 2 bad options).

    ``argv`` is a list of arguments, or the namespace the ``cnrstore demo`` CLI parsed
    with ``add_arguments`` (its ``--no-progress`` is honoured too).
    """
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        parser = argparse.ArgumentParser(prog="python -m cnrstore.demo.driver", description=__doc__)
        add_arguments(parser)
        args = parser.parse_args(argv)
    tmp = None
    # torch.optim.Adagrad's sparse update warns once per process that torch's (default)
    # sparse invariant checks are off; the demo's output should show the demo.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly")
    try:
        _check(args)
        if args.worker:
            return _worker(args)
        args.temporary = args.store is None
        if args.temporary:
            tmp = tempfile.TemporaryDirectory(prefix="cnrstore-demo-")
            args.store = tmp.name
        elif Path(args.store).exists() and any(Path(args.store).iterdir()):
            raise _Failed(f"{args.store} is not empty; give a new directory")
        return _drive(args)
    except _Failed as exc:
        print(f"cnrstore demo: {exc}", file=sys.stderr)
        return exc.code
    finally:
        if tmp is not None:
            tmp.cleanup()


def _drive(args: argparse.Namespace) -> int:
    import cnrstore

    show = (not args.quiet and not getattr(args, "no_progress", False)
            and sys.stderr.isatty())
    say = (lambda text: None) if args.quiet else (lambda text: print(text, flush=True))
    say(f"training with checkpoints; the trainer is killed at step {args.fail_at}")
    run1: list[dict] = []
    code = _spawn(args, kill_at=args.fail_at, events=run1,
                  bar=_bar("train", args.steps, show))
    if code != -signal.SIGKILL:
        raise _Failed(f"the trainer exited with {code} before the kill", code=1)
    say("killed; a new process restores the latest step and finishes")
    run2: list[dict] = []
    code = _spawn(args, kill_at=None, events=run2, bar=_bar("resume", args.steps, show))
    if code != 0:
        raise _Failed(f"the resumed trainer failed with exit code {code}", code=1)
    say("uninterrupted reference run")
    ref = _reference(args, _bar("reference", args.steps, show))
    floor = teacher_floor(SyntheticCTR(_config(args)).eval_batches(EVAL_BATCHES))
    with cnrstore.open(args.store) as store:
        # A serving job that follows the trainer by changes only (cnrstore/demo/serving.py),
        # across the kill and the resume.
        served = serving.follow(store, every=args.publish_every) if args.publish_every else None
        if served is not None and not served.identical:
            raise _Failed(served.line(), code=1)
        before = disk_bytes(args.store)
        n_steps = len(store.steps())
        store.gc(keep_last=2)
        after = disk_bytes(args.store)
        kept = store.steps()
    gc_line = (f"gc(keep_last=2): {n_steps} steps -> {kept}, "
               f"disk {_mb(before).strip()} -> {_mb(after).strip()}")
    if served is not None:
        gc_line = f"{served.line()}\n{gc_line}"
    print(_report(args, run1, run2, ref, gc_line, floor, after))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``cnrstore`` command: a thin argparse layer over cnrstore.tools and the store API.

Every subcommand prints a human-readable table by default and one JSON document with
``--json``. Exit codes: 0 ok, 1 problems found (verify, repair damage, a store error),
2 usage (bad arguments, a missing store or step); an error's code is its class's
``exit_code`` (cnrstore/errors.py). Errors are one line on stderr; ``--debug`` shows the
traceback instead.

Start-up is part of the interface: ``--help`` imports no more than argparse and the error
classes, and the read-only commands (ls, show, du, diff, verify) open the engine store
directly and never import torch (tests/test_cli_imports.py; figures in docs/PERFORMANCE.md).
``gc --dry-run`` is one of them. Only the commands that put or get tables (import,
export, gc, rm, rollback, demo) load the store API.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cnrstore.cli.arguments import (
    common_flags,
    parse_count,
    parse_quant,
    parse_step,
    parse_step_or_latest,
    resolve_step,
)
from cnrstore.cli.locate import (
    cache_dir_of,
    gc_grace_of,
    is_shared,
    is_url,
    open_objects,
    open_store,
    require_store,
)
from cnrstore.errors import EXIT_OK, EXIT_PROBLEMS, CheckpointError, UsageError, engine_errors

if TYPE_CHECKING:
    from cnrstore.core.store import CheckpointStore
    from cnrstore.tools.progress import Progress
    from engine import ObjectStore

__all__ = ["build_parser", "main"]

def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser. The demo's options are added only when ``argv`` names the
    demo (or is None), because loading the demo module costs time every other command
    would pay."""
    common = common_flags(suppress=True)
    parser = argparse.ArgumentParser(
        prog="cnrstore", parents=[common_flags(suppress=False)],
        description="Inspect and maintain a cnrstore checkpoint store.",
        epilog="Exit codes: 0 ok, 1 problems found, 2 usage error.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_, description=help_)
        if name != "demo":
            p.add_argument("store", metavar="STORE",
                           help="path of the store directory, or s3://bucket/prefix")
        return p

    add("ls", "list the kept steps with their sizes")
    p = add("show", "show the tables of one step")
    p.add_argument("step", type=parse_step_or_latest, metavar="STEP", help="a step, or latest")
    p = add("diff", "which tables, blocks and rows differ between two steps")
    p.add_argument("a", type=parse_step_or_latest, metavar="A", help="a step, or latest")
    p.add_argument("b", type=parse_step_or_latest, metavar="B", help="a step, or latest")
    p.add_argument("--no-rows", action="store_true",
                   help="stop at blocks: do not decode changed blocks to find rows")
    p.add_argument("--max-rows", type=int, default=20, metavar="N",
                   help="row ids shown per table in the human output (default 20)")
    p = add("verify", "check the integrity of the store (exit 1 if problems)")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument("--deep", action="store_true",
                       help="re-read and re-hash every object and decode every block "
                            "(the default, as in Python's verify())")
    depth.add_argument("--shallow", action="store_true",
                       help="check only the structure: no payload re-hash or block decoding")
    p.add_argument("--step", type=parse_step_or_latest, action="append", dest="steps",
                   metavar="S", help="check only this step, or latest (repeatable)")
    p = add("repair", "rebuild the index from the pack files, keeping every step that "
                      "still partly reads (prints its plan first)")
    p.add_argument("--dry-run", action="store_true",
                   help="only scan the packs and say what repair would keep, roll back or "
                        "drop; change nothing")
    p = add("gc", "drop old steps and reclaim their bytes")
    p.add_argument("--keep-last", type=parse_count, metavar="N",
                   help="keep the newest N steps")
    p.add_argument("--keep", type=parse_step, action="append", default=[], metavar="S",
                   help="also keep step S (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="only say what would be dropped and freed")
    p = add("rm", "delete steps (all or none, in one commit); gc reclaims their bytes")
    p.add_argument("steps", type=parse_step, nargs="+", metavar="STEP")
    p = add("rollback", "delete every step after STEP (one commit), to resume from STEP")
    p.add_argument("step", type=parse_step, metavar="STEP")
    add("du", "logical vs stored bytes, dedup and compression, per table")
    p = add("export", "write one step's tables to a .safetensors file")
    p.add_argument("step", type=parse_step_or_latest, metavar="STEP", help="a step, or latest")
    p.add_argument("path", metavar="OUT.safetensors")
    p.add_argument("--table", action="append", dest="names", metavar="NAME",
                   help="export only this table (repeatable)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing regular file (never a device, FIFO or folder)")
    p = add("import", "store the tensors of a .safetensors file as a new step")
    p.add_argument("step", type=parse_step, metavar="STEP")
    p.add_argument("path", metavar="IN.safetensors")
    p.add_argument("--quant", action="append", metavar="[NAME=]SCHEME",
                   help="scheme of table NAME, or without NAME of every floating-point "
                   "table (integer tables stay exact); repeatable. Default: the schemes "
                   "the file was exported with, else exact")
    _add_changes(sub, common)
    p = add("demo", "run the demo: a small DLRM trained with checkpoints, killed, resumed")
    if argv is None or "demo" in argv:
        _add_demo_arguments(p)
    return parser


def _add_changes(sub, common: argparse.ArgumentParser) -> None:
    help_ = ("write the changes from step A to step B to a .safetensors file a serving "
             "job can read, or (--apply) replay such a file onto a replica file")
    p = sub.add_parser("changes", parents=[common], help=help_, description=help_,
                       usage="cnrstore changes STORE A B --out FILE.safetensors "
                             "[--table NAME ...] [--strict] [--force]\n"
                             "       cnrstore changes --apply FILE.safetensors "
                             "--to REPLICA.safetensors")
    p.add_argument("store", nargs="?", metavar="STORE",
                   help="path of the store directory, or s3://bucket/prefix")
    p.add_argument("a", nargs="?", type=parse_step, metavar="A")
    p.add_argument("b", nargs="?", type=parse_step, metavar="B")
    p.add_argument("--out", metavar="FILE.safetensors", help="the changes file to write")
    p.add_argument("--table", action="append", dest="names", metavar="NAME",
                   help="only this table (repeatable)")
    p.add_argument("--strict", action="store_true",
                   help="also read the older blocks it takes to leave out rows written "
                        "back to their value")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.add_argument("--apply", metavar="FILE.safetensors",
                   help="replay this changes file onto --to")
    p.add_argument("--to", metavar="REPLICA.safetensors",
                   help="a safetensors file of step A's tables (cnrstore export), "
                        "rewritten as step B")


def _changes(args: argparse.Namespace) -> int:
    from cnrstore.tools import changefile

    if args.apply is not None:
        if args.to is None or args.store is not None or args.out is not None:
            raise UsageError("changes --apply FILE takes --to REPLICA and no STORE A B or --out")
        result = changefile.apply_file(args.apply, args.to)
    else:
        if args.b is None or args.out is None or args.to is not None:
            raise UsageError("changes: give STORE A B --out FILE.safetensors "
                             "(or --apply FILE --to REPLICA)")
        with open_store(args.store, readonly=True, cache_dir=cache_dir_of(args)) as store:
            result = changefile.write_changes(store, args.a, args.b, args.out,
                                              names=args.names, overwrite=args.force,
                                              strict=args.strict)
    _emit(args, result, result.text())
    return EXIT_OK


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        from cnrstore.demo import driver as demo
    except ImportError as exc:
        parser.set_defaults(demo_error=f"the demo is not available: {exc}")
        return
    demo.add_arguments(parser)
    from cnrstore.demo import torchrec_demo  # imports TorchRec only when it runs

    torchrec_demo.add_arguments(parser)


# Commands served by cnrstore.tools on the engine store alone (no torch); so is gc --dry-run.
_VIEW_COMMANDS = frozenset({"ls", "show", "diff", "du", "verify"})


def _is_view(args: argparse.Namespace) -> bool:
    return args.command in _VIEW_COMMANDS or (args.command == "gc" and args.dry_run)


def _progress(args: argparse.Namespace, label: str) -> Progress:
    from cnrstore.tools.progress import Progress

    return Progress(label, enabled=not args.no_progress and sys.stderr.isatty())


def _emit(args: argparse.Namespace, data: object, human: str) -> None:
    from cnrstore.cli import fmt

    if args.json:
        json.dump(fmt.jsonable(data), sys.stdout, indent=2, sort_keys=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(human.rstrip("\n") + "\n")


def _run(args: argparse.Namespace) -> int:
    from cnrstore.cli import fmt

    cmd = args.command
    if cmd == "demo":
        if getattr(args, "demo_error", None):
            raise UsageError(args.demo_error)
        if getattr(args, "torchrec", False):
            from cnrstore.demo import torchrec_demo

            return int(torchrec_demo.main(args) or 0)
        from cnrstore.demo import driver as demo

        return int(demo.main(args) or 0)
    if cmd == "changes":
        return _changes(args)
    if cmd == "repair":
        from cnrstore.tools import info

        cache_dir = cache_dir_of(args)
        if is_url(args.store) or is_shared(args.store) or cache_dir:
            # Its index cache, rebuilt from the commit documents (or the packs when one is
            # damaged, named in the report).
            if args.dry_run:
                raise UsageError(f"{args.store}: --dry-run is for directory stores")
            require_store(args.store, cache_dir)
            report = info.repair(args.store, cache_dir=cache_dir)
            _emit(args, report, fmt.repair_text(report))
            return EXIT_PROBLEMS if report.damaged else EXIT_OK
        require_store(args.store)

        def say_plan(plan) -> None:  # before anything is written
            if not args.json:
                sys.stdout.write(fmt.repair_plan_text(plan) + "\n")
                sys.stdout.flush()

        report = info.repair(args.store, dry_run=args.dry_run, on_plan=say_plan)
        if args.dry_run:
            if args.json:
                _emit(args, report, "")
        else:
            _emit(args, report, fmt.repair_text(report))
        return EXIT_PROBLEMS if report.damaged else EXIT_OK
    if _is_view(args):
        with open_objects(args.store, cache_dir_of(args)) as objects:
            return _view(args, objects)
    if cmd == "export":  # before opening the store: a bad target is said at once
        from cnrstore.tools.transfer import export_target

        export_target(args.path, overwrite=args.force, flag="--force")
    with open_store(args.store, create=cmd == "import", readonly=cmd == "export",
               cache_dir=cache_dir_of(args)) as store:
        return _change(args, store)


def _view(args: argparse.Namespace, objects: ObjectStore) -> int:
    """The read-only commands, on the engine store."""
    from cnrstore.cli import fmt
    from cnrstore.tools import info

    cmd = args.command
    if cmd == "ls":
        with _progress(args, "ls") as bar:
            steps = info.list_steps(objects, progress=bar)
        _emit(args, steps, fmt.steps_text(steps))
        damaged = [s.step for s in steps if s.problem is not None]
        if damaged:
            print(f"cnrstore ls: {fmt.plural(len(damaged), 'step')} cannot be read "
                  f"({', '.join(map(str, damaged))}); `cnrstore verify {args.store}` lists "
                  "what is damaged", file=sys.stderr)
            return EXIT_PROBLEMS
    elif cmd == "show":
        detail = info.show_step(objects, resolve_step(objects, args.step))
        _emit(args, detail, fmt.step_text(detail))
    elif cmd == "diff":
        diff = info.diff_steps(objects, resolve_step(objects, args.a),
                               resolve_step(objects, args.b), rows=not args.no_rows)
        _emit(args, diff, fmt.diff_text(diff, max_rows=args.max_rows))
    elif cmd == "gc":  # --dry-run: the plan reads the index and manifests only
        plan = info.gc_plan(objects, keep_last=args.keep_last, keep=args.keep)
        _emit(args, plan, fmt.gc_plan_text(plan))
    elif cmd == "du":
        with _progress(args, "du") as bar:
            usage = info.disk_usage(objects, progress=bar)
        _emit(args, usage, fmt.usage_text(usage))
    elif cmd == "verify":
        chosen = None if args.steps is None else [resolve_step(objects, s) for s in args.steps]
        with _progress(args, "verify") as bar:
            report = info.verify(objects, deep=not args.shallow, steps=chosen, progress=bar)
        _emit(args, report, fmt.verify_text(report))
        return EXIT_OK if report.ok else EXIT_PROBLEMS
    return EXIT_OK


def _change(args: argparse.Namespace, store: CheckpointStore) -> int:
    """The commands that need the store API: gc, rm, rollback, export, import."""
    from cnrstore.cli import fmt
    from cnrstore.tools import info, transfer

    cmd = args.command
    if cmd == "gc":
        # Neither --keep-last nor --keep: drop no step, reclaim only unreachable bytes.
        done = info.collect(store, keep_last=args.keep_last, keep=args.keep,
                            grace_s=gc_grace_of(args.store))
        _emit(args, done, fmt.gc_text(done))
    elif cmd in ("rm", "rollback"):
        if cmd == "rm":
            deleted = store.delete_steps(args.steps)
        else:
            deleted = store.rollback(args.step)
        steps = ", ".join(map(str, deleted)) or "none"
        _emit(args, {"deleted": deleted, "steps": store.steps()},
              f"deleted steps: {steps}\n(`cnrstore gc {args.store}` reclaims their bytes)")
    elif cmd == "export":
        with _progress(args, "export") as bar:
            result = transfer.export_step(store, resolve_step(store.objects, args.step),
                                          args.path, names=args.names,
                                          overwrite=args.force, progress=bar)
        _emit(args, result, fmt.transfer_text(result))
    elif cmd == "import":
        with _progress(args, "import") as bar:
            result = transfer.import_step(store, args.step, args.path,
                                          quant=parse_quant(args.quant), progress=bar)
        _emit(args, result, fmt.transfer_text(result))
    return EXIT_OK


def _exit_code(exc: BaseException) -> int:
    # The class says (borg's way). Anything else is a fault of ours or of the system (an
    # OSError the engine let through, a bug): a problem, not the user's usage.
    return exc.exit_code if isinstance(exc, CheckpointError) else EXIT_PROBLEMS


def _message(exc: BaseException, store: str | None) -> str:
    from cnrstore.errors import CorruptData

    text = str(exc)
    text = " ".join(text.split()) or type(exc).__name__
    if isinstance(exc, UsageError):
        return text
    hint = ""
    if isinstance(exc, CorruptData) and store:
        hint = f"; `cnrstore verify {store}` lists what is damaged"
    return f"{text} ({type(exc).__name__}{hint})"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cnrstore`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help exits 0, bad usage 2
        return int(exc.code or 0)
    try:
        with engine_errors():  # the last boundary: engine errors leave as cnrstore's
            return _run(args)
    except KeyboardInterrupt:
        print("cnrstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``cnrstore ls STORE | head``): not an error of ours. Point
        # stdout at devnull so the interpreter's final flush does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        if args.debug:
            raise
        message = _message(exc, getattr(args, "store", None))
        print(f"cnrstore {args.command}: error: {message}", file=sys.stderr)
        return _exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())

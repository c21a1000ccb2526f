"""Where the time of a cnrstore put and get goes, by wall-clock timers around its stages.

cProfile sees only the calling thread, and a put does half its work on the store's writer
thread (and a get decodes blocks in a pool), so this wraps the functions of each stage, in
the modules that call them, with timers that work in every thread. Time is counted
*exclusively*: a stage's time excludes the timed stages it calls, so the stages add up to
the thread-seconds the timers saw. The rest of the wall time is "untimed" (Python glue,
waiting); with parallel decode the thread-seconds can exceed the wall time.

    .venv/bin/python benches/profile_put.py --scale 0.1 --schemes exact,int8

The stage map names real functions of cnrstore/ and engine/; a renamed function is
reported as missing rather than silently not timed. Functions that wait on other threads
(the get's read_table, the blocking put's Future) are deliberately not timed: their
exclusive time would be the waiting, counted twice.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benches.measure import evict_page_cache  # noqa: E402
from benches.workload import Workload, apply_update, make_tables, table_specs  # noqa: E402

__all__ = ["StageTimers", "main", "profile"]

# (module, attribute -- "Class.method" for methods, stage). The module is where the name is
# looked up at call time, i.e. the caller's module for `from x import f` names.
STAGES = (
    ("cnrstore.core.snapshot", "row_fingerprints", "fingerprint"),
    ("cnrstore.core.snapshot", "fingerprints_and_changes", "fingerprint + diff (one pass)"),
    ("cnrstore.core.snapshot", "_changed_old_rows", "diff vs seed codes"),
    ("cnrstore.core.hostcodes", "first_nonfinite_row", "NaN/Inf check"),
    ("cnrstore.core.snapshot", "first_nonfinite_row", "NaN/Inf check"),
    ("cnrstore.core.hostcodes", "encode_rows", "quantize / encode rows"),
    ("cnrstore.core.snapshot", "gather_encode", "gather + copy to host"),
    ("cnrstore.core.snapshot", "snapshot_rows", "copy changed rows (encode deferred)"),
    ("cnrstore.core.blockplan", "next_slot", "chain policy (next_slot)"),
    ("cnrstore.core.put", "plan_table", "plan blocks (other)"),
    ("cnrstore.core.put", "queued", "queue the step (drops the old bases)"),
    ("cnrstore.core.writer", "encode_full", "block payload (full)"),
    ("cnrstore.core.writer", "encode_patch", "block payload (patch)"),
    ("cnrstore.core.commit", "write_step", "manifest + writer glue (other)"),
    ("engine.store.writer", "object_id", "hash: object id (engine put)"),
    ("engine.store.writer", "PackWriter.has", "dedup lookups (has)"),
    ("engine.format.records", "encode_record", "record framing (other)"),
    ("engine.storage.local", "write_all", "write (pack append)"),
    ("engine.packs.pack", "PackFile.append", "write (pack append)"),
    ("engine.packs.pack", "PackFile.sync", "fsync"),
    ("engine.packs.pack", "fsync_dir", "fsync"),
    ("engine.store.writer", "PackWriter.commit", "commit: index txn + roots (other)"),
    ("cnrstore.core.placement", "seed_state", "seed diff base from store"),
    # get
    ("engine.packs.pack", "pread_exact", "read (pread)"),
    ("engine.format.records", "_decompress", "decompress"),
    ("engine.format.records", "object_id", "hash: verify id on read"),
    ("engine.format.records", "check_record", "record checksum + header"),
    ("engine.store.core", "PackStoreState.lookup", "index lookup"),
    ("cnrstore.core.restore", "decode_rows", "dequantize / decode rows"),
    ("cnrstore.format.blocks", "decode_full", "block decode"),
    ("cnrstore.format.blocks", "decode_patch", "block decode"),
)


class StageTimers:
    """Exclusive per-stage seconds, summed over threads; install() patches, remove() undoes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.missing: list[str] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._undo: list[tuple[Any, str, Any]] = []

    def _wrap(self, fn, stage: str):
        timers = self

        def timed(*args, **kwargs):
            stack = timers._local.__dict__.setdefault("stack", [])
            frame = [0.0]  # seconds spent in timed children
            stack.append(frame)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dur = time.perf_counter() - t0
                stack.pop()
                if stack:
                    stack[-1][0] += dur
                with timers._lock:
                    timers.seconds[stage] = timers.seconds.get(stage, 0.0) + dur - frame[0]
                    timers.calls[stage] = timers.calls.get(stage, 0) + 1

        timed.__wrapped__ = fn
        return timed

    def _patch(self, owner, attr: str, stage: str) -> None:
        self._undo.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, self._wrap(getattr(owner, attr), stage))

    def install(self) -> None:
        for module_name, attr, stage in STAGES:
            owner = importlib.import_module(module_name)
            *cls, name = attr.split(".")
            for c in cls:
                owner = getattr(owner, c, None)
            if owner is None or name not in vars(owner):
                self.missing.append(f"{module_name}.{attr}")
                continue
            self._patch(owner, name, stage)
        self._patch_c_calls()

    def _patch_c_calls(self) -> None:
        # zstd compression and the record checksum are C methods: wrap them through the
        # module objects that engine/ calls them by.
        import xxhash
        import zstandard

        import engine.format.records
        import engine.store.writer

        timers = self
        compress_stage = self._wrap(lambda cctx, data: cctx.compress(data), "compress (zstd)")

        class _Cctx:
            def __init__(self, **kw):
                self._real = zstandard.ZstdCompressor(**kw)

            def compress(self, data):
                return compress_stage(self._real, data)

        class _ModuleProxy:
            def __init__(self, real, **over):
                self._real, self._over = real, over

            def __getattr__(self, name):
                return self._over.get(name) or getattr(self._real, name)

        checksum = timers._wrap(xxhash.xxh3_64_intdigest, "checksum (xxh3-64)")
        for module, attr, proxy in (
            (engine.store.writer, "zstandard", _ModuleProxy(zstandard, ZstdCompressor=_Cctx)),
            (engine.format.records, "xxhash", _ModuleProxy(xxhash, xxh3_64_intdigest=checksum)),
        ):
            self._undo.append((module, attr, getattr(module, attr)))
            setattr(module, attr, proxy)

    def remove(self) -> None:
        while self._undo:
            owner, attr, value = self._undo.pop()
            setattr(owner, attr, value)

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """(seconds, calls) per stage since the last take; resets both."""
        with self._lock:
            out, calls = self.seconds, self.calls
            self.seconds, self.calls = {}, {}
        return out, calls


def _phase(timers: StageTimers, name: str, fn) -> dict[str, Any]:
    timers.take()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    seconds, calls = timers.take()
    stages = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
    return {"phase": name, "wall_s": wall, "stages": stages, "calls": calls,
            "untimed_s": wall - sum(stages.values())}


def profile(*, scale: float, schemes: list[str], workload: Workload, seed: int = 0,
            workdir: Path | None = None) -> list[dict[str, Any]]:
    """Full put, one incremental put, the stall of a non-blocking one and the writer's
    rest of it, and a cold get of the latest step, per scheme."""
    import cnrstore

    timers = StageTimers()
    timers.install()
    phases = []
    try:
        for scheme in schemes:
            tmp = Path(tempfile.mkdtemp(prefix="cnrprof-", dir=workdir))
            try:
                tables = make_tables(table_specs(scale=scale), seed=seed)
                store = cnrstore.open(str(tmp / "store"))

                def put(step, store=store, tables=tables, scheme=scheme):
                    return lambda: store.put_tables(step, tables, quant=scheme)

                phases.append(_phase(timers, f"{scheme}: full put", put(0)))
                apply_update(tables, workload, seed=seed, step=1)
                phases.append(_phase(timers, f"{scheme}: incremental put ({workload.name})",
                                     put(1)))
                # The stall: until put_tables(blocking=False) returns. Writer-thread stages
                # that overlap it are counted in it; the wait for the writer is the next.
                apply_update(tables, workload, seed=seed, step=2)
                pending: list = []

                def stall(store=store, tables=tables, scheme=scheme, pending=pending):
                    pending.append(store.put_tables(2, tables, quant=scheme, blocking=False))

                phases.append(_phase(timers, f"{scheme}: stall of a blocking=False put", stall))
                phases.append(_phase(timers, f"{scheme}: its writer, after the stall",
                                     lambda pending=pending: pending[0].result()))
                store.close()
                evict_page_cache(tmp)

                def get(path=str(tmp / "store")):
                    with cnrstore.open(path) as s:
                        s.get_tables(2)

                phases.append(_phase(timers, f"{scheme}: cold get of the latest step", get))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        timers.remove()
    for p in phases:
        p["missing_stages"] = timers.missing
    return phases


def markdown(phases: list[dict[str, Any]], logical_mb: float) -> str:
    lines = []
    for p in phases:
        lines += [f"### {p['phase']} ({logical_mb:.0f} MB logical): {p['wall_s']:.2f} s wall",
                  "", "| stage | s | % of wall | calls |", "|---|---|---|---|"]
        for stage, s in p["stages"].items():
            if s >= 0.0005:
                lines.append(f"| {stage} | {s:.3f} | {100 * s / p['wall_s']:.0f}% "
                             f"| {p['calls'].get(stage, 0)} |")
        lines += [f"| untimed (glue, waits; < 0 when threads overlap) | {p['untimed_s']:.3f} "
                  f"| {100 * p['untimed_s'] / p['wall_s']:.0f}% | |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--schemes", default="exact,int8")
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--dist", default="zipf")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, help="also write the phases here")
    args = p.parse_args(argv)
    if args.scale <= 0:
        p.error("--scale must be > 0")
    try:
        workload = Workload(args.fraction, args.dist)
    except ValueError as exc:
        p.error(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    phases = profile(scale=args.scale, schemes=args.schemes.split(","), workload=workload)
    logical = sum(r * d * 4 for r, d in table_specs(scale=args.scale).values()) / 1e6
    if phases and phases[0]["missing_stages"]:
        print("not timed (renamed?):", ", ".join(phases[0]["missing_stages"]), file=sys.stderr)
    print(markdown(phases, logical))
    if args.json:
        args.json.write_text(json.dumps({"scale": args.scale, "logical_mb": logical,
                                         "threads": args.threads, "phases": phases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

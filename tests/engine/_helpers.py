"""Shared pieces of the engine's proof tests: deterministic objects, disk usage, and the
worker processes that the crash and concurrency tests start, kill and watch.

Payloads are self-describing (seed and size in the first 16 bytes, the rest derived from
the seed), so any process can tell a right payload from a wrong one without a shared
oracle. Run as a script (``python _helpers.py CMD ...``) this module is the worker: each
command prints one line per finished step, flushed, so the parent knows exactly what was
committed before it killed the worker.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import engine
from engine.api import Object
from engine.errors import CorruptObject, ObjectNotFound, StoreError
from engine.format.ids import object_id
from engine.testing import make_payload, payload_ok  # noqa: F401 - the workers' payloads

HERE = pathlib.Path(__file__).resolve()
DATA_KIND = 1
NODE_KIND = 2
SHARED_SEED = 7  # one leaf every DAG shares, so every commit also exercises dedup


# -- stores ----------------------------------------------------------------------------
def open_store(path, **kw):
    """Open (creating if missing) the real pack store at ``path``."""
    return engine.open(str(path), **kw)


def _open_kw() -> dict:
    return json.loads(os.environ.get("CNR_OPEN_KW", "{}"))


# -- deterministic objects -------------------------------------------------------------
def dag(i: int, *, size: int = 4096, leaves: int = 3) -> tuple[bytes, dict[bytes, Object]]:
    """The DAG of commit ``i``: ``leaves`` data objects of about ``size`` bytes plus the
    shared leaf, under one metadata node. Returns (top id, {id: object}) in put order."""
    objs: dict[bytes, Object] = {}
    seeds = [SHARED_SEED] + [1000 * (i + 1) + k for k in range(leaves)]
    for seed in seeds:
        obj = Object(DATA_KIND, (), make_payload(seed, size))
        objs[object_id(obj.kind, obj.refs, obj.payload)] = obj
    node = Object(NODE_KIND, tuple(objs), make_payload(10**9 + i, 64))
    top = object_id(node.kind, node.refs, node.payload)
    objs[top] = node
    return top, objs


def put_dag(w, i: int, *, size: int = 4096, leaves: int = 3, root: bool = True) -> bytes:
    top, objs = dag(i, size=size, leaves=leaves)
    for oid, obj in objs.items():
        got = w.put(obj.kind, obj.payload, obj.refs, meta=obj.kind == NODE_KIND)
        assert got == oid
    if root:
        w.set_root(f"r{i}", top)
    return top


def check_dag(store, i: int, *, size: int = 4096, leaves: int = 3) -> None:
    """Assert that root r{i} exists and its whole DAG reads back byte for byte."""
    top, objs = dag(i, size=size, leaves=leaves)
    assert store.root(f"r{i}") == top, f"root r{i} moved or missing"
    for oid, obj in objs.items():
        got = store.get(oid)
        assert got == obj, f"object {oid.hex()} of r{i} read back wrong"


def dag_absent(store, i: int, *, size: int = 4096, leaves: int = 3) -> bool:
    """True if no object private to DAG ``i`` (all but the shared leaf) is visible."""
    _, objs = dag(i, size=size, leaves=leaves)
    shared = object_id(DATA_KIND, (), make_payload(SHARED_SEED, size))
    return store.root(f"r{i}") is None and not any(
        store.has(oid) for oid in objs if oid != shared
    )


# -- files -----------------------------------------------------------------------------
def pack_files(path) -> list[pathlib.Path]:
    return sorted(p for p in pathlib.Path(path).rglob("*.pack") if p.is_file())


def allocated(files) -> int:
    """Bytes allocated on disk (not apparent size) by ``files``."""
    return sum(os.stat(p).st_blocks * 512 for p in files)


def pack_bytes(path) -> int:
    return allocated(pack_files(path))


def find_in_packs(path, needle: bytes) -> tuple[pathlib.Path, int]:
    """The pack and offset where ``needle`` occurs (payloads of random bytes are stored
    verbatim even by zstd, which keeps incompressible blocks raw)."""
    for p in pack_files(path):
        at = p.read_bytes().find(needle)
        if at >= 0:
            return p, at
    raise AssertionError(f"{needle[:8].hex()}... not found in any pack")


# -- worker processes ------------------------------------------------------------------
def spawn(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    full_env = dict(os.environ)
    full_env.pop("CNRSTORE_CRASH_AT", None)
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, str(HERE), *map(str, args)],
        env=full_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def run(*args: str, env: dict | None = None, timeout: float = 60) -> tuple[int, list[str], str]:
    """Run a worker to its end (or its own SIGKILL); return (returncode, lines, stderr)."""
    proc = spawn(*args, env=env)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.splitlines(), err


def committed(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("committed ")]


def _say(msg: str) -> None:
    print(msg, flush=True)


def _cmd_write(path: str, start: str, count: str, size: str) -> None:
    with engine.open(path, **_open_kw()) as store:
        for i in range(int(start), int(start) + int(count)):
            with store.writer(timeout=30) as w:
                put_dag(w, i, size=int(size))
            _say(f"committed {i}")


def _cmd_churn(path: str, start: str, size: str, seconds: str) -> None:
    """Commit, drop old roots and gc, in a loop: the writer that is killed at random
    moments and that readers run against. Roots r0..r{start-1} are never touched."""
    deadline = time.monotonic() + float(seconds)
    first = i = int(start)
    with engine.open(path, **_open_kw()) as store:
        while time.monotonic() < deadline:
            with store.writer(timeout=30) as w:
                put_dag(w, i, size=int(size))
                if i - first >= 2:
                    w.delete_root(f"r{i - 2}")
            _say(f"committed {i}")
            if i % 3 == 0:
                report = store.gc(threshold=0.0, timeout=30)
                _say(f"gc {i} {report.objects_freed} {report.packs_rewritten}")
            i += 1


def _cmd_gc(path: str, threshold: str) -> None:
    with engine.open(path, **_open_kw()) as store:
        report = store.gc(threshold=float(threshold), timeout=30)
        _say(f"gc {report.objects_freed} {report.bytes_freed}")


def _cmd_read(path: str, seconds: str, stable: str) -> None:
    """Read root r{stable}'s DAG and whatever other roots exist, in a loop. Exit 3 on
    wrong data; objects of roots dropped meanwhile may vanish (ObjectNotFound), those of
    the stable root never may."""
    deadline = time.monotonic() + float(seconds)
    reads = vanished = 0
    with engine.open(path, **_open_kw()) as store:
        stable_top = store.root(f"r{stable}")
        _say("open")
        while time.monotonic() < deadline:
            for name, top in list(store.roots().items()):
                stack = [top]
                while stack:
                    oid = stack.pop()
                    try:
                        obj = store.get(oid)
                    except ObjectNotFound:
                        if top == stable_top:
                            raise
                        vanished += 1
                        break
                    if object_id(obj.kind, obj.refs, obj.payload) != oid or not payload_ok(
                        obj.payload
                    ):
                        _say(f"WRONG {name} {oid.hex()}")
                        sys.exit(3)
                    reads += 1
                    stack.extend(obj.refs)
    _say(f"reads {reads} vanished {vanished}")


def _cmd_repair(path: str, seconds: str) -> None:
    """Say "open", then rebuild the index from the packs over and over for ``seconds``:
    the worker the random-kill repair test shoots at."""
    deadline = time.monotonic() + float(seconds)
    with engine.open(path, **_open_kw()) as store:
        _say("open")
        k = 0
        while time.monotonic() < deadline:
            store.repair()
            _say(f"repaired {k}")
            k += 1


def _cmd_verify_loop(path: str, seconds: str) -> None:
    """verify(deep=True) in a loop: exit 3 at the first report of damage (the store is
    healthy; only concurrent writes and gc are going on)."""
    deadline = time.monotonic() + float(seconds)
    runs = 0
    with engine.open(path, **_open_kw()) as store:
        while time.monotonic() < deadline:
            report = store.verify(deep=True)
            if not report.ok:
                _say(f"FALSE {report.problems[:3]}")
                sys.exit(3)
            runs += 1
    _say(f"verified {runs}")


def _cmd_try_writer(path: str, timeout: str) -> None:
    with engine.open(path, **_open_kw()) as store:
        _say("trying")
        t0 = time.monotonic()
        try:
            w = store.writer(timeout=float(timeout))
        except engine.StoreLocked as exc:
            _say(f"locked {time.monotonic() - t0:.3f} {exc}")
            return
        with w:
            put_dag(w, 900)
        _say(f"acquired {time.monotonic() - t0:.3f}")


def _cmd_hold_writer(path: str, seconds: str) -> None:
    with engine.open(path, **_open_kw()) as store:
        with store.writer() as w:
            _say("holding")
            time.sleep(float(seconds))
            put_dag(w, 901)
        _say("released")


def _cmd_watch(path: str, i: str) -> None:
    """Open the store, say so, wait for a line on stdin, then read root r{i}'s DAG with
    the handle opened before: a long-lived reader must see later commits."""
    with engine.open(path, **_open_kw()) as store:
        _say("open")
        sys.stdin.readline()
        check_dag(store, int(i))
        assert store.verify(deep=True).ok
        _say(f"saw {i}")


def _cmd_survive(path: str, kept: str) -> None:
    """Open a store whose index was damaged, then verify, gc, repair, gc: every root in
    ``kept`` (comma-separated numbers) must come out whole. Only StoreError may be raised
    by the store (each step says so and goes on); anything else, or a lost root, fails
    the process. The parent checks that it did not die of a signal."""
    wanted = [int(i) for i in kept.split(",") if i]
    with engine.open(path) as store:
        _say("opened")
        for step in ("verify", "gc", "repair", "gc"):
            try:
                if step == "verify":
                    rep = store.verify(deep=True)
                    _say(f"verify ok={rep.ok} problems={len(rep.problems)}")
                elif step == "gc":
                    rep = store.gc(threshold=0.0)
                    unreadable = len(getattr(rep, 'unreadable', ()))
                    _say(f"gc freed={rep.objects_freed} unreadable={unreadable}")
                else:
                    rep = store.repair()
                    _say(f"repair roots={rep.roots_restored} damaged={len(rep.damaged)}")
            except StoreError as exc:
                _say(f"{step} refused {type(exc).__name__}: {str(exc)[:200]}")
        for i in wanted:
            check_dag(store, i)
        report = store.verify(deep=True)
        assert report.ok, report.problems
    _say("survived")


def _cmd_repair_once(path: str) -> None:
    with engine.open(path) as store:
        rep = store.repair()
        _say(f"repaired roots={rep.roots_restored}")


COMMANDS = {
    "survive": _cmd_survive,
    "repair_once": _cmd_repair_once,
    "write": _cmd_write,
    "churn": _cmd_churn,
    "gc": _cmd_gc,
    "read": _cmd_read,
    "try_writer": _cmd_try_writer,
    "hold_writer": _cmd_hold_writer,
    "watch": _cmd_watch,
    "verify_loop": _cmd_verify_loop,
    "repair": _cmd_repair,
}

if __name__ == "__main__":
    try:
        COMMANDS[sys.argv[1]](*sys.argv[2:])
    except (CorruptObject, StoreError, AssertionError) as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)

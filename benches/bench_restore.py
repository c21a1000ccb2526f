"""Restore targets of issue 27, all in one run against their peers measured beside them.

One store per scheme (exact, int8) holds a full put and ``--steps`` incremental puts at 5%
Zipf changes (benches/workload.py), so the step restored reads its patch chains; the peer
is torch.save of the same tables (one file). A training state (the tables as nn.Embedding
weights plus a stepped Adam's state) is put with put_state and torch.save'd too. Every
repeat measures, in an interleaved order that changes each repeat:

- cold ``get_tables`` (exact, int8) and cold ``torch.load`` (page cache of the files
  evicted first, benches/measure.py), the bytes each read from the disk (/proc/self/io
  ``read_bytes``), and the disk's rate: a cold sequential read of a file as large as what
  the exact restore read (16 MiB ``readinto``);
- warm ``get_tables`` (exact) against warm ``torch.load``;
- in place: ``get_tables(out=)`` into existing tables against ``torch.load`` + ``copy_``,
  both cold;
- ``load_state`` into a live model and Adam plus ``opt.load_state_dict`` of its result,
  against ``torch.load`` plus ``load_state_dict`` of both; ``get_state`` against
  ``torch.load``, all cold.

Figures: medians of ``--repeat`` runs of each time and of each ratio taken within a
repeat. One command, one process (the machine it ran on is in the output):

    .venv/bin/python benches/bench_restore.py --repeat 5 --out /tmp/restore.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import cnrstore  # noqa: E402
from benches.measure import evict_page_cache  # noqa: E402
from benches.workload import Workload, apply_update, make_tables, table_specs  # noqa: E402

TARGETS = {  # ratio name -> the most it may be (issue 27)
    "cold_int8_over_torch_load": 0.5,
    "cold_exact_over_disk_time": 1.05,
    "load_state_over_torch": 1.0,
    "get_state_over_torch_load": 1.2,
    "inplace_int8_over_torch_copy": 0.6,
    "inplace_exact_over_torch_copy": 0.6,
    "warm_exact_over_torch_load": 1.0,
}


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _cold(path: Path, fn) -> tuple[float, int, Any]:
    """(seconds, bytes read from the disk, result) of ``fn()`` after evicting ``path``."""
    evict_page_cache(path)
    b0 = _read_bytes()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, _read_bytes() - b0, out


def _sequential_read(path: Path) -> float:
    """Seconds to read ``path`` cold, front to back, 16 MiB at a time."""
    evict_page_cache(path)
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


class Model(torch.nn.Module):
    def __init__(self, tables: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.embs = torch.nn.ModuleDict(
            {n: torch.nn.Embedding(*t.shape, _weight=t.clone()) for n, t in tables.items()})


def _training_state(tables: dict[str, torch.Tensor]) -> tuple[Model, torch.optim.Adam]:
    model = Model(tables)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # the moments exist: a resumed job's optimizer
    for p in model.parameters():
        p.grad = None
    return model, opt


def _state(model: Model, opt: torch.optim.Adam) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def prepare(root: Path, scale: float, steps: int, seed: int) -> dict[str, Any]:
    tables = make_tables(table_specs(scale=scale), seed=seed)
    work = Workload(0.05, "zipf")
    for scheme in ("exact", "int8"):
        t = {n: v.clone() for n, v in tables.items()}
        with cnrstore.open(root / scheme) as s:
            s.put_tables(0, t, quant=scheme)
            for step in range(1, steps + 1):
                apply_update(t, work, seed=seed, step=step)
                s.put_tables(step, t, quant=scheme)
    for step in range(1, steps + 1):
        apply_update(tables, work, seed=seed, step=step)
    with open(root / "tables.pt", "wb") as f:
        torch.save(tables, f)
    model, opt = _training_state(tables)
    with cnrstore.open(root / "state") as s:
        s.put_state(1, _state(model, opt))
    with open(root / "state.pt", "wb") as f:
        torch.save(_state(model, opt), f)
    os.sync()
    return {"tables": tables, "model": model, "opt": opt,
            "table_bytes": sum(t.nbytes for t in tables.values()),
            "state_bytes": sum(v.nbytes for v in tables.values()) * 3}


def one_repeat(root: Path, steps: int, ctx: dict[str, Any], order: int) -> dict[str, float]:
    tables, model, opt = ctx["tables"], ctx["model"], ctx["opt"]
    out: dict[str, float] = {}

    def get(scheme: str) -> Any:
        with cnrstore.open(root / scheme) as s:
            return s.get_tables(steps)

    def torch_load(name: str) -> Any:
        return torch.load(root / name, map_location="cpu", weights_only=True)

    def cold_tables() -> None:
        out["cold_torch_load_s"], out["cold_torch_load_bytes"], got = _cold(
            root / "tables.pt", lambda: torch_load("tables.pt"))
        del got
        for scheme in ("exact", "int8"):
            s, b, got = _cold(root / scheme, lambda scheme=scheme: get(scheme))
            if scheme == "exact":
                assert all(torch.equal(got[n], tables[n]) for n in tables)
            out[f"cold_{scheme}_s"], out[f"cold_{scheme}_bytes"] = s, b
            del got
        probe = root / "probe.bin"
        if not probe.exists() or probe.stat().st_size != out["cold_exact_bytes"]:
            with open(probe, "wb") as f:  # incompressible, as a store's bytes are
                left = max(1, int(out["cold_exact_bytes"]))
                while left:
                    n = min(left, 16 << 20)
                    f.write(os.urandom(n))
                    left -= n
                os.fsync(f.fileno())
        out["disk_read_s"] = _sequential_read(probe)

    def warm() -> None:
        torch_load("tables.pt")
        t0 = time.perf_counter()
        got = torch_load("tables.pt")
        out["warm_torch_load_s"] = time.perf_counter() - t0
        del got
        get("exact")
        t0 = time.perf_counter()
        got = get("exact")
        out["warm_exact_s"] = time.perf_counter() - t0
        del got

    def in_place() -> None:
        dest = {n: torch.zeros_like(t) for n, t in tables.items()}

        def copy() -> None:
            got = torch_load("tables.pt")
            for n, t in got.items():
                dest[n].copy_(t)

        out["inplace_torch_copy_s"] = _cold(root / "tables.pt", copy)[0]
        for scheme in ("int8", "exact"):
            def into(scheme: str = scheme) -> None:
                with cnrstore.open(root / scheme) as s:
                    s.get_tables(steps, out=dest)
            out[f"inplace_{scheme}_s"] = _cold(root / scheme, into)[0]
        assert all(torch.equal(dest[n], tables[n]) for n in tables)  # exact, bit for bit

    def states() -> None:
        def torch_resume() -> None:
            sd = torch_load("state.pt")
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        def cnr_resume() -> None:
            with cnrstore.open(root / "state") as s:
                back = s.load_state(1, _state(model, opt))
            opt.load_state_dict(back["optim"])

        def cnr_get() -> Any:
            with cnrstore.open(root / "state") as s:
                return s.get_state(1)

        out["state_torch_resume_s"] = _cold(root / "state.pt", torch_resume)[0]
        out["state_load_state_s"] = _cold(root / "state", cnr_resume)[0]
        s, _, got = _cold(root / "state.pt", lambda: torch_load("state.pt"))
        out["state_torch_load_s"] = s
        del got
        s, _, got = _cold(root / "state", cnr_get)
        out["state_get_state_s"] = s
        del got

    parts = [cold_tables, warm, in_place, states]
    for i in range(len(parts)):
        parts[(i + order) % len(parts)]()
    out["cold_int8_over_torch_load"] = out["cold_int8_s"] / out["cold_torch_load_s"]
    out["cold_exact_over_torch_load"] = out["cold_exact_s"] / out["cold_torch_load_s"]
    out["cold_exact_over_disk_time"] = out["cold_exact_s"] / out["disk_read_s"]
    out["load_state_over_torch"] = out["state_load_state_s"] / out["state_torch_resume_s"]
    out["get_state_over_torch_load"] = out["state_get_state_s"] / out["state_torch_load_s"]
    out["inplace_int8_over_torch_copy"] = out["inplace_int8_s"] / out["inplace_torch_copy_s"]
    out["inplace_exact_over_torch_copy"] = out["inplace_exact_s"] / out["inplace_torch_copy_s"]
    out["warm_exact_over_torch_load"] = out["warm_exact_s"] / out["warm_torch_load_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.43, help="table rows x (0.43: 462 MB)")
    p.add_argument("--steps", type=int, default=3, help="incremental puts after the full")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cnr-restore-", dir=args.workdir) as tmp:
        root = Path(tmp)
        ctx = prepare(root, args.scale, args.steps, args.seed)
        runs = [one_repeat(root, args.steps, ctx, r) for r in range(args.repeat)]
        sizes = {"exact_store": _du(root / "exact"), "int8_store": _du(root / "int8"),
                 "torch_save_file": (root / "tables.pt").stat().st_size}
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    doc = {"meta": {"scale": args.scale, "steps": args.steps, "repeat": args.repeat,
                    "table_bytes": ctx["table_bytes"], "state_bytes": ctx["state_bytes"],
                    "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                    "machine": platform.machine(), "torch": torch.__version__,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "sizes": sizes, "median": med, "runs": runs,
           "targets": {k: {"max": v, "median": med[k], "ok": med[k] <= v}
                       for k, v in TARGETS.items()}}
    text = json.dumps(doc, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    for k, v in med.items():
        print(f"{k:34s} {v:12.4f}" if v < 1e6 else f"{k:34s} {v / 1e6:10.1f} MB")
    for k, t in doc["targets"].items():
        print(f"target {k}: {t['median']:.3f} <= {t['max']} {'ok' if t['ok'] else 'MISSED'}")
    return 0


def _du(path: Path) -> int:
    from benches.measure import disk_bytes

    return disk_bytes(path)


if __name__ == "__main__":
    sys.exit(main())

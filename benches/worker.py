"""One benchmark job, run in a subprocess of its own so its memory peak is its own.

A job is one system over a list of workloads: for each, build the tables, put one full and
``steps`` incremental checkpoints, then restore the latest and the oldest step cold.
Run as ``python -m benches.worker SPECS.json RESULTS.json`` with a JSON list of job specs:
one job per process isolates memory peaks best; several in one process save the ~3 s of
importing torch per job (quick runs), and per-phase peaks stay exact where the kernel
lets us reset the high-water mark (benches/measure.py).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from benches.measure import PeakMemory, disk_bytes, evict_page_cache, timed
from benches.peers import make_system
from benches.workload import Workload, apply_update, make_tables

__all__ = ["fingerprint_job", "run_job", "tables_digest"]

_ERR_CHUNK_ROWS = 1 << 16
_WARM_REPEAT = 3


def tables_digest(tables: dict[str, torch.Tensor]) -> str:
    """xxh3-128 of names, shapes, dtypes and raw bytes: equal iff bit-identical tables."""
    h = xxhash.xxh3_128()
    for name in sorted(tables):
        t = tables[name].detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _errors(orig: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    if set(orig) != set(got):
        return {"same_names": False}
    max_abs, sq_err, sq_ref = 0.0, 0.0, 0.0
    same_layout = True
    for name, ref in orig.items():
        out = got[name]
        if out.shape != ref.shape or out.dtype != ref.dtype:
            same_layout = False
            continue
        # In row chunks: float64 copies of a whole 1 GB table would triple the job's peak.
        for lo in range(0, ref.shape[0], _ERR_CHUNK_ROWS):
            r = ref[lo : lo + _ERR_CHUNK_ROWS].to(torch.float64)
            diff = out[lo : lo + _ERR_CHUNK_ROWS].to(torch.float64) - r
            if diff.numel():
                max_abs = max(max_abs, float(diff.abs().max()))
            sq_err += float(diff.square().sum())
            sq_ref += float(r.square().sum())
    return {
        "same_names": True,
        "same_layout": same_layout,
        "bit_exact": tables_digest(orig) == tables_digest(got),
        "max_abs_err": max_abs,
        "rel_rmse": math.sqrt(sq_err / sq_ref) if sq_ref else 0.0,
    }


def _run_workload(spec: dict[str, Any], workload: Workload, mem: PeakMemory) -> dict[str, Any]:
    seed, steps = spec["seed"], spec["steps"]
    specs = {k: tuple(v) for k, v in spec["tables"].items()}
    root = Path(spec["workdir"]) / f"{spec['system']}-{workload.name}"
    shutil.rmtree(root, ignore_errors=True)
    gen_s, tables = timed(lambda: make_tables(specs, seed=seed))
    oldest_digest = tables_digest(tables)
    system = make_system(spec["system"], root)
    records = []
    mem.start()
    for step in range(steps + 1):
        touched: dict | None = None  # step 0 is the full checkpoint: nothing to track
        rows = None
        if step:
            touched = {}
            rows = apply_update(tables, workload, seed=seed, step=step, touched=touched)
        before = disk_bytes(root)
        rec = system.put(step, tables, touched=touched)
        after = disk_bytes(root)
        rec.update(step=step, bytes_written=after - before, cum_bytes=after, rows_updated=rows)
        records.append(rec)
    put_mem = mem.stop()
    system.close()

    cache = evict_page_cache(root, drop_caches=spec["drop_caches"])
    mem.start()
    latest_s, restored = timed(lambda: system.restore(steps))
    restore_mem = mem.stop()
    latest_err = _errors(tables, restored)
    del restored
    # Warm: the files the cold read just brought into the page cache. Three restores, the
    # median reported and the first kept beside it: on a 2-vCPU VM, filling ~1 GB of fresh
    # memory took 0.5-1.3 s of kernel time between identical calls of a threaded restore
    # (page-fault and LRU locks contended, a vCPU halted while its peer was descheduled);
    # torch.load's single thread varied little. One sample each was the noisiest figure.
    warm = []
    for _ in range(_WARM_REPEAT):
        s, restored = timed(lambda: system.restore(steps))
        del restored
        warm.append(s)
    warm_s = statistics.median(warm)
    # In place, warm: into tensors that already exist and were touched (a model's); the
    # peak counts what the restore allocates beyond them.
    model = {k: torch.zeros_like(v) for k, v in tables.items()}
    mem.start()
    inplace_s, _ = timed(lambda m=model: system.restore_into(steps, m))
    inplace_mem = mem.stop()
    inplace_exact = tables_digest(model) == tables_digest(tables)
    del model
    evict_page_cache(root, drop_caches=spec["drop_caches"])
    oldest_s, restored = timed(lambda: system.restore(0))
    oldest_exact = tables_digest(restored) == oldest_digest
    del restored
    system.close()
    for path in system.paths():
        shutil.rmtree(path, ignore_errors=True)
    return {
        "workload": workload.name,
        "logical_bytes": sum(t.numel() * t.element_size() for t in tables.values()),
        "gen_s": gen_s,
        "steps": records,
        "restore_latest_s": latest_s,
        "restore_oldest_s": oldest_s,
        "restore_warm_s": warm_s,
        "restore_warm_first_s": warm[0],
        "restore_warm_samples_s": warm,
        "restore_inplace_s": inplace_s,
        "inplace_bit_exact": inplace_exact,
        "inplace_peak_over_start": inplace_mem["peak_over_start"],
        "latest_error": latest_err,
        "oldest_bit_exact": oldest_exact,
        "put_peak_rss": put_mem["peak_rss"],
        "put_peak_over_start": put_mem["peak_over_start"],
        "restore_peak_rss": restore_mem["peak_rss"],
        "restore_peak_over_start": restore_mem["peak_over_start"],
        "cache_eviction": cache,
    }


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec['system']`` over ``spec['workloads']`` ([fraction, dist] pairs)."""
    mem = PeakMemory()
    out = {"system": spec["system"], "memory_method": mem.method, "workloads": {}}
    for fraction, dist in spec["workloads"]:
        w = Workload(float(fraction), dist)
        out["workloads"][w.name] = _run_workload(spec, w, mem)
    return out


def fingerprint_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Row-fingerprint throughput (GB/s) of the largest table, on CPU and CUDA if present."""
    try:
        from cnrstore.codec.fingerprint import row_fingerprints
    except ImportError as exc:
        return {"available": False, "reason": f"cnrstore.codec.fingerprint: {exc}"}
    name, (rows, dim) = next(iter(spec["tables"].items()))
    table = make_tables({name: (rows, dim)}, seed=spec["seed"])[name]
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out: dict[str, Any] = {"available": True, "bytes": table.numel() * 4, "rows": rows}
    for device in devices:
        t = table.to(device)
        row_fingerprints(t[: min(rows, 1024)])  # warm up kernels / lazy init

        def once(t=t, device=device):
            fp = row_fingerprints(t)
            if device == "cuda":
                torch.cuda.synchronize()
            return fp

        times = sorted(timed(once)[0] for _ in range(spec.get("fp_repeat", 3)))
        median = times[len(times) // 2]
        out[device] = {"median_s": median, "gb_per_s": out["bytes"] / 1e9 / median}
    return out


def main(argv: list[str]) -> int:
    spec_path, result_path = argv
    results = []
    for spec in json.loads(Path(spec_path).read_text()):
        if spec.get("threads"):
            torch.set_num_threads(int(spec["threads"]))
        t0 = time.perf_counter()
        result = fingerprint_job(spec) if spec["system"] == "fingerprint" else run_job(spec)
        result["job_s"] = time.perf_counter() - t0
        results.append(result)
    Path(result_path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""GPU benchmarks of issue 27 (run by benches/gpu_check.sh; needs CUDA): the fingerprint pass
on a GPU table, and put, stall and get of GPU-resident tables against torch.save and
torch.load from and to the GPU, measured in the same run.

    python benches/bench_gpu.py --json /tmp/gpu.json            # 8 GiB fingerprint, 2 GB puts
    python benches/bench_gpu.py --json /tmp/gpu.json --quick    # seconds

- fingerprint: row_fingerprints over a [rows, 64] fp32 CUDA table, GB/s of table bytes
  (median of 5 after a warm-up; target >= 1000 GB/s), beside a read pass (an int64 sum
  over the same bytes) and a device-to-device copy of them.
- puts: the tables of benches/workload.py moved to the GPU, a full put and ``--steps``
  incremental puts (5% Zipf rows changed on the GPU) of cnr_int8 with blocking=False
  (stall and put) and cnr_exact, taking turns with torch.save+fsync of the same GPU tables
  (benches/peers.py TorchSave, both ways, the faster the peer).
- gets: the latest step to the GPU (get_tables(device="cuda")), page cache cold and warm,
  against torch.load(map_location="cuda") of the same step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def _sync() -> None:
    torch.cuda.synchronize()


def _median_s(fn, reps: int) -> float:
    fn()
    _sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fingerprint(gib: float) -> dict:
    from cnrstore.codec.fingerprint import row_fingerprints

    rows = int(gib * 2**30) // (64 * 4)
    t = torch.randn(rows, 64, device="cuda")
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    nbytes = t.numel() * 4
    fp_s = _median_s(lambda t=t, out=out: row_fingerprints(t, out=out), 5)
    words = t.view(torch.int64)
    read_s = _median_s(lambda w=words: w.sum(), 5)
    dst = torch.empty_like(t)
    copy_s = _median_s(lambda t=t, dst=dst: dst.copy_(t), 5)
    cpu_equal = bool(torch.equal(row_fingerprints(t[:4096].cpu()), out[:4096].cpu()))
    del t, out, dst, words
    torch.cuda.empty_cache()
    return {"table_bytes": nbytes, "fingerprint_gbs": nbytes / fp_s / 1e9,
            "read_pass_gbs": nbytes / read_s / 1e9, "copy_gbs": nbytes / copy_s / 1e9,
            "target_gbs": 1000.0, "met": nbytes / fp_s / 1e9 >= 1000.0,
            "matches_cpu_on_first_rows": cpu_equal}


def puts_and_gets(gb: float, steps: int, work: Path) -> dict:
    import cnrstore
    from benches.measure import evict_page_cache
    from benches.peers import TorchSave
    from benches.workload import BASE_ROWS, Workload, apply_update, make_tables, table_specs

    scale = gb * 1e9 / (sum(BASE_ROWS[:4]) * 64 * 4)
    specs = dict(list(table_specs(scale=scale).items())[:4])
    tables = {k: v.cuda() for k, v in make_tables(specs, seed=0).items()}
    logical = sum(t.numel() * 4 for t in tables.values())
    peer = TorchSave(work / "torch_save")
    stores = {"cnr_int8_async": cnrstore.open(str(work / "int8")),
              "cnr_exact": cnrstore.open(str(work / "exact"))}
    rec: dict = {"torch_save": [], "cnr_int8_async": [], "cnr_exact": []}
    workload = Workload(0.05, "zipf")
    for step in range(steps + 1):
        if step:
            apply_update(tables, workload, seed=0, step=step)
            _sync()
        rec["torch_save"].append(peer.put(step, tables))
        t0 = time.perf_counter()
        fut = stores["cnr_int8_async"].put_tables(step, tables, quant="int8", blocking=False)
        stall = time.perf_counter() - t0
        fut.result()
        rec["cnr_int8_async"].append({"stall_s": stall, "put_s": time.perf_counter() - t0})
        t0 = time.perf_counter()
        stores["cnr_exact"].put_tables(step, tables, quant="exact")
        rec["cnr_exact"].append({"put_s": time.perf_counter() - t0})
    for s in stores.values():
        s.close()
    ts = [r["put_s"] for r in rec["torch_save"]]
    out: dict = {"logical_bytes": logical, "steps": rec, "ratios": {}}
    for system in ("cnr_int8_async", "cnr_exact"):
        incr = rec[system][1:]
        out["ratios"][system] = {
            "full_put_ratio": rec[system][0]["put_s"] / ts[0],
            "incr_put_ratio": statistics.median(r["put_s"] / t for r, t in zip(incr, ts[1:])),
        }
    out["ratios"]["cnr_int8_async"]["stall_ratio"] = statistics.median(
        r["stall_s"] / t for r, t in zip(rec["cnr_int8_async"][1:], ts[1:]))
    del tables
    torch.cuda.empty_cache()

    def load_ts():
        return torch.load(peer._path(steps), map_location="cuda", weights_only=True)

    def get(path):
        def run():
            with cnrstore.open(str(path)) as s:
                return s.get_tables(steps, device="cuda")
        return run

    gets: dict = {}
    for name, fn, root in (("torch_load", load_ts, peer.root),
                           ("cnr_exact", get(work / "exact"), work / "exact"),
                           ("cnr_int8", get(work / "int8"), work / "int8")):
        evict_page_cache(root)
        t0 = time.perf_counter()
        got = fn()
        _sync()
        cold = time.perf_counter() - t0
        del got
        warm = _median_s(lambda fn=fn: fn(), 2)
        gets[name] = {"cold_s": cold, "warm_s": warm}
    for name in ("cnr_exact", "cnr_int8"):
        gets[name]["cold_ratio"] = gets[name]["cold_s"] / gets["torch_load"]["cold_s"]
        gets[name]["warm_ratio"] = gets[name]["warm_s"] / gets["torch_load"]["warm_s"]
    out["gets"] = gets
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--fp-gib", type=float, default=8.0)
    p.add_argument("--put-gb", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--skip-puts", action="store_true",
                   help="fingerprint only (cnrstore's storage dependencies are missing)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.fp_gib, args.put_gb, args.steps = 0.25, 0.05, 1
    if not torch.cuda.is_available():
        args.json.write_text(json.dumps({"gpu": False}))
        print("no CUDA device: nothing measured")
        return 0
    doc: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    doc["fingerprint"] = fingerprint(args.fp_gib)
    print(json.dumps({"fingerprint": doc["fingerprint"]}), flush=True)
    if not args.skip_puts:
        work = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=args.workdir))
        try:
            doc["puts"] = puts_and_gets(args.put_gb, args.steps, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({"ratios": doc["puts"]["ratios"], "gets": doc["puts"]["gets"]}))
    args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of restoring a table into a model's existing tensor (issue 10).

    .venv/bin/python benches/bench_inplace.py --mib 400            # prints a table + JSON

One table of ``--mib`` MiB (fp32, ``--width`` columns) is put into a cnrstore store and
written with torch.save. Then each restore runs in its own fresh process, which first
allocates and touches the destination tensor (the model), and reports how far its peak RSS
(ru_maxrss) grew during the restore, as a fraction of the table size:

- ``get_tables``:       ``t.copy_(store.get_tables()[name])`` -- a second full copy
- ``get_tables_out``:   ``store.get_tables(out={name: t})``  -- decoded in place
- ``torch_load``:       ``t.copy_(torch.load(f)[name])``
- ``torch_load_mmap``:  ``t.copy_(torch.load(f, mmap=True)[name])`` (mapped file pages count)

In-place restores stay at bounded per-block buffers (decode_threads x block size).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cnrstore  # noqa: E402

MODES = ("get_tables", "get_tables_out", "torch_load", "torch_load_mmap")


def _peak_bytes() -> int:
    """Peak RSS of this process (VmHWM). Not ru_maxrss: Linux carries that over fork and
    exec from the parent, which held the table while preparing it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: KiB


def _reset_peak() -> None:
    try:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def worker(mode: str, path: str, rows: int, width: int, threads: int) -> dict:
    """Run one restore in this process; return its peak RSS growth."""
    model = torch.empty(rows, width)
    model.fill_(1.0)  # touch every page: the model already lives in memory
    store = cnrstore.open(os.path.join(path, "store"), decode_threads=threads)
    ckpt = os.path.join(path, "table.pt")
    _reset_peak()
    before = _peak_bytes()
    t0 = time.perf_counter()
    if mode == "get_tables":
        model.copy_(store.get_tables(1)["t"])
    elif mode == "get_tables_out":
        store.get_tables(1, out={"t": model})
    elif mode == "torch_load":
        model.copy_(torch.load(ckpt)["t"])
    elif mode == "torch_load_mmap":
        model.copy_(torch.load(ckpt, mmap=True)["t"])
    else:
        raise ValueError(mode)
    seconds = time.perf_counter() - t0
    growth = _peak_bytes() - before
    store.close()
    return {"mode": mode, "table_bytes": rows * width * 4, "peak_growth_bytes": growth,
            "growth_over_table": growth / (rows * width * 4), "seconds": seconds}


def run_worker(mode: str, path: str, rows: int, width: int, threads: int) -> dict:
    """``worker`` in a fresh subprocess (its own peak RSS)."""
    out = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--path", path, "--rows", str(rows),
         "--width", str(width), "--threads", str(threads)],
        capture_output=True, text=True, timeout=900, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def prepare(path: str, rows: int, width: int, *, torch_file: bool = True) -> None:
    table = torch.randn(rows, width, generator=torch.Generator().manual_seed(0))
    with cnrstore.open(os.path.join(path, "store")) as s:
        s.put_tables(1, {"t": table})
    if torch_file:
        torch.save({"t": table}, os.path.join(path, "table.pt"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=400)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--threads", type=int, default=8, help="decode threads of the store")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args.rows, args.width, args.threads)))
        return
    rows = args.mib * (1 << 20) // (4 * args.width)
    with tempfile.TemporaryDirectory(prefix="cnr-inplace-") as path:
        prepare(path, rows, args.width)
        results = [run_worker(m, path, rows, args.width, args.threads)
                   for m in args.modes.split(",")]
    print(f"table: {rows} x {args.width} fp32 = {rows * args.width * 4 / 2**20:.0f} MiB, "
          f"decode_threads={args.threads}")
    print(f"{'mode':<18}{'peak RSS growth':>18}{'/ table':>10}{'seconds':>10}")
    for r in results:
        print(f"{r['mode']:<18}{r['peak_growth_bytes'] / 2**20:>14.1f} MiB"
              f"{r['growth_over_table']:>10.2f}{r['seconds']:>10.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Where a cold exact restore's disk time goes: get_tables against a front-to-back read of
as many bytes and against torch.load, with the disk requests each issued.

bench_restore.py's store (five tables at ``--scale``, a full put and ``--steps``
incremental puts at 5% Zipf, the latest step restored: its full blocks and patch chains);
every repeat evicts the files (posix_fadvise DONTNEED) and times, in turn, the sequential
read of a random file as large as the restore's reads (16 MiB ``readinto``: the
"disk rate" of issue 27), ``get_tables`` and ``torch.load``. Beside the seconds: CPU seconds
of the process (user + system) and, from /proc/diskstats of the store's device, the read
requests, their mean size and the summed time they were in flight (``ms_reading``: high
when many requests queue at once). One command:

    .venv/bin/python benches/restore_io.py --repeat 3
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import cnrstore  # noqa: E402
from benches.bench_restore import _read_bytes, _sequential_read  # noqa: E402
from benches.measure import evict_page_cache  # noqa: E402
from benches.workload import Workload, apply_update, make_tables, table_specs  # noqa: E402


def _device(path: Path) -> str:
    dev = os.stat(path).st_dev
    name = f"{os.major(dev)}:{os.minor(dev)}"
    try:
        return Path(f"/sys/dev/block/{name}").resolve().name
    except OSError:
        return ""


def _disk(dev: str) -> tuple[int, int, int]:
    """(reads completed, sectors read, ms spent reading) of block device ``dev``."""
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[3]), int(p[5]), int(p[6])
    return 0, 0, 0


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.43)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cnr-restore-io-", dir=args.workdir) as tmp:
        root = Path(tmp)
        t = make_tables(table_specs(scale=args.scale), seed=0)
        work = Workload(0.05, "zipf")
        with cnrstore.open(root / "exact") as s:
            s.put_tables(0, t, quant="exact")
            for step in range(1, args.steps + 1):
                apply_update(t, work, seed=0, step=step)
                s.put_tables(step, t, quant="exact")
        with open(root / "tables.pt", "wb") as f:
            torch.save(t, f)
        os.sync()
        dev = _device(root / "tables.pt")

        def get() -> object:
            with cnrstore.open(root / "exact") as s:
                return s.get_tables(args.steps)

        def load() -> object:
            return torch.load(root / "tables.pt", map_location="cpu", weights_only=True)

        get()  # imports, lazily loaded modules
        runs: dict[str, list[dict[str, float]]] = {"disk": [], "get_tables": [], "torch_load": []}
        for _ in range(args.repeat):
            for name, path, fn in (("get_tables", root / "exact", get),
                                   ("torch_load", root / "tables.pt", load)):
                evict_page_cache(path)
                d0, c0, b0, t0 = _disk(dev), _cpu(), _read_bytes(), time.perf_counter()
                got = fn()
                dt = time.perf_counter() - t0
                d1, c1, b1 = _disk(dev), _cpu(), _read_bytes()
                assert name != "get_tables" or all(
                    torch.equal(got[n], t[n]) for n in t)  # type: ignore[index]
                del got
                runs[name].append({"s": dt, "cpu_s": c1 - c0, "MB": (b1 - b0) / 1e6,
                                   "requests": d1[0] - d0[0],
                                   "request_KB": (d1[1] - d0[1]) * 0.512 / max(1, d1[0] - d0[0]),
                                   "ms_reading": d1[2] - d0[2]})
            probe = root / "probe.bin"
            if not probe.exists():
                with open(probe, "wb") as f:  # incompressible, as the store's bytes are
                    left = int(runs["get_tables"][0]["MB"] * 1e6)
                    while left > 0:
                        n = min(left, 16 << 20)
                        f.write(os.urandom(n))
                        left -= n
                    os.fsync(f.fileno())
            d0 = _disk(dev)
            dt = _sequential_read(probe)
            d1 = _disk(dev)
            runs["disk"].append({"s": dt, "cpu_s": 0.0, "MB": probe.stat().st_size / 1e6,
                                 "requests": d1[0] - d0[0],
                                 "request_KB": (d1[1] - d0[1]) * 0.512 / max(1, d1[0] - d0[0]),
                                 "ms_reading": d1[2] - d0[2]})
    print(f"load before/after: {os.getloadavg()}")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{name:11s} " + " ".join(f"{k}={v:.3f}" if k.endswith("s") else f"{k}={v:.0f}"
                                        for k, v in med.items())
              + f"  s: {[round(r['s'], 3) for r in rs]}")
    ratio = [g["s"] / d["s"] for g, d in zip(runs["get_tables"], runs["disk"])]
    ratio_t = [g["s"] / d["s"] for g, d in zip(runs["get_tables"], runs["torch_load"])]
    print(f"get_tables / disk: median {statistics.median(ratio):.2f} "
          f"{[round(x, 2) for x in ratio]}")
    print(f"get_tables / torch.load: median {statistics.median(ratio_t):.2f} "
          f"{[round(x, 2) for x in ratio_t]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Open time of a store directory by the size of its LMDB index, and how many times an open
walks the index file (engine/index/lmdbcheck.py), median of --repeat opens per size.

    .venv/bin/python benches/bench_open.py --objects 10000 100000 --out /tmp/open

Compare two trees by running it twice with PYTHONPATH at each (same stores, same run)."""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time

import engine
from engine.index import lmdbcheck


def build(path: pathlib.Path, objects: int) -> int:
    if not path.exists():
        with engine.open(path) as store:
            for start in range(0, objects, 5000):
                with store.writer() as w:
                    ids = [w.put(1, os.urandom(24)) for _ in range(min(5000, objects - start))]
                    w.set_root(f"r{start}", w.put(2, b"top", ids[:10], meta=True))
    return os.path.getsize(path / "index" / "data.mdb")


def time_open(path: pathlib.Path, repeat: int, readonly: bool) -> tuple[float, float]:
    walks = [0]
    real = lmdbcheck._walk_all

    def counted(*a, **kw):
        walks[0] += 1
        return real(*a, **kw)

    lmdbcheck._walk_all = counted
    try:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            engine.open(path, readonly=readonly).close()
            times.append(time.perf_counter() - t0)
    finally:
        lmdbcheck._walk_all = real
    return statistics.median(times), walks[0] / repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print("| objects | data.mdb | open (writable) | open (read-only) | walks per open |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.objects:
        path = args.out / f"s{n}"
        size = build(path, n)
        rw, walks = time_open(path, args.repeat, False)
        ro, _ = time_open(path, args.repeat, True)
        print(f"| {n:,} | {size / 2**20:.1f} MiB | {rw * 1e3:.1f} ms | {ro * 1e3:.1f} ms "
              f"| {walks:.0f} |")


if __name__ == "__main__":
    main()

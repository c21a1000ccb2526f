"""Throughput of row fingerprints and of row quantization, on CPU and (when present) CUDA.

    .venv/bin/python benches/bench_fingerprint.py --mib 1024 --width 64
    .venv/bin/python benches/bench_fingerprint.py --mib 64 --quant --changed 0.05

Prints GB/s of table bytes (best of --reps runs after one warm-up, so buffer allocation and
first-touch of fresh memory are excluded, as in a training loop that checkpoints often).
Encode figures are for the changed fraction of the table (--changed), the rows a put
quantizes. On a shared machine run it when idle: figures swing with other load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cnrstore.codec.fingerprint import row_fingerprints  # noqa: E402
from cnrstore.codec.quantize import decode_rows, encode_rows  # noqa: E402


def _best(fn, reps: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def bench_device(device: str, args) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = args.mib * 2**20 // (4 * args.width)
    table = torch.randn(rows, args.width, device=device)
    nbytes = table.numel() * table.element_size()
    out = torch.empty(rows, dtype=torch.int64, device=device)
    t = _best(lambda: row_fingerprints(table, out=out), args.reps, sync)
    print(
        f"{device:4s} fingerprint fp32 [{rows} x {args.width}] {nbytes / 2**20:.0f} MiB: "
        f"{t * 1e3:8.1f} ms  {nbytes / t / 1e9:6.2f} GB/s"
    )
    odd = table[:, : args.width - 1]  # odd width: padded, strided copy path
    t = _best(lambda: row_fingerprints(odd, out=out), args.reps, sync)
    nb = odd.numel() * 4
    print(
        f"{device:4s} fingerprint fp32 strided width {args.width - 1}: "
        f"{t * 1e3:8.1f} ms  {nb / t / 1e9:6.2f} GB/s"
    )
    if not args.quant:
        return
    changed = table[: max(1, int(rows * args.changed))].clone()
    nb = changed.numel() * 4
    for scheme in ("exact", "fp16", "int8", "int4", "int3", "int2"):
        searches = ("minmax", "greedy") if scheme.startswith("int") else (None,)
        for search in searches:
            t = _best(lambda s=scheme, q=search: encode_rows(changed, s, search=q), 1, sync)
            codes = encode_rows(changed, scheme, search=search)
            td = _best(
                lambda s=scheme, c=codes: decode_rows(c, s, torch.float32, args.width), 1, sync
            )
            label = f"{scheme}/{search}" if search else scheme
            print(
                f"{device:4s} encode {label:13s} {nb / 2**20:7.1f} MiB: {t * 1e3:8.1f} ms "
                f"{nb / t / 1e6:8.1f} MB/s   decode {nb / td / 1e6:8.1f} MB/s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="table size in MiB (fp32)")
    parser.add_argument("--width", type=int, default=64, help="row width in elements")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quant", action="store_true", help="also time encode/decode")
    parser.add_argument("--changed", type=float, default=0.05, help="fraction encoded")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    bench_device("cpu", args)
    if torch.cuda.is_available():
        bench_device("cuda", args)


if __name__ == "__main__":
    main()

"""Put/get throughput of a cnrstore on S3 next to torch.save + one upload with the same
client (obstore), against a loopback S3 server (runs: benches/results/bench_s3.md).

    .venv/bin/python benches/bench_s3.py                  # 1 GB, SeaweedFS started here
    .venv/bin/python benches/bench_s3.py --gb 0.05 --out /tmp/s3b    # smoke
    .venv/bin/python benches/bench_s3.py --endpoint http://127.0.0.1:8333 --bucket b

Tables: ``--tables`` fp32 tables of 64-dim rows, standard-normal values (about 7%
compressible by zstd), ``--gb`` in all. Measured, each once per repeat (median reported):

- torch_save: ``torch.save`` to a local file, then ``obstore.put`` of the file (multipart,
  same chunk size and concurrency as the store); restore: ``obstore.get`` + ``torch.load``.
- cnr_s3: ``put_tables`` of step 1 (fingerprint, encode, compress, stage, upload, commit);
  restore ``get_tables`` with the warm cache, and from an empty cache (rebuild + get).
- cnr_s3 incremental: step 2 after 5% of each table's rows changed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "engine"))  # _weed: the test suite's weed fixture

import obstore  # noqa: E402
import torch  # noqa: E402

import cnrstore  # noqa: E402
from engine.storage.s3 import make_store, resolve_options  # noqa: E402

CHUNK = 8 << 20
CONCURRENCY = 8


def make_tables(gb: float, n: int, dim: int = 64) -> dict[str, torch.Tensor]:
    rows = int(gb * 1e9 / 4 / dim / n)
    g = torch.Generator().manual_seed(0)
    return {f"emb{i}": torch.randn(rows, dim, generator=g) for i in range(n)}


def nbytes(tables: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tables.values())


def bench_torch_save(tables, options, bucket, prefix, workdir) -> dict:
    config, tuning = resolve_options(options)
    store = make_store(bucket, prefix, config, tuning)
    path = pathlib.Path(workdir) / "ckpt.pt"
    t0 = time.perf_counter()
    torch.save(tables, path)
    t1 = time.perf_counter()
    obstore.put(store, "ckpt.pt", path, use_multipart=True, chunk_size=CHUNK,
                max_concurrency=CONCURRENCY)
    t2 = time.perf_counter()
    data = obstore.get(store, "ckpt.pt").bytes()
    t3 = time.perf_counter()
    back = torch.load(io.BytesIO(memoryview(data)), weights_only=True)
    t4 = time.perf_counter()
    assert all(torch.equal(back[k], tables[k]) for k in tables)
    size = path.stat().st_size
    path.unlink()
    obstore.delete(store, "ckpt.pt")
    return {"save_s": t1 - t0, "upload_s": t2 - t1, "put_s": t2 - t0,
            "download_s": t3 - t2, "load_s": t4 - t3, "get_s": t4 - t2, "stored": size}


def bench_cnr(tables, options, url, workdir, threads: int) -> dict:
    cache = pathlib.Path(workdir) / "cache"
    opts = dict(options, chunk_size=CHUNK, max_concurrency=CONCURRENCY)
    s = cnrstore.open(url, cache_dir=cache, storage_options=opts, decode_threads=threads)
    t0 = time.perf_counter()
    s.put_tables(1, tables)
    t1 = time.perf_counter()
    got = s.get_tables(1)
    t2 = time.perf_counter()
    assert all(torch.equal(got[k], tables[k]) for k in tables)
    del got
    g = torch.Generator().manual_seed(1)
    changed = {}
    for k, t in tables.items():
        t = t.clone()
        idx = torch.randperm(t.shape[0], generator=g)[: t.shape[0] // 20]
        t[idx] = torch.randn(len(idx), t.shape[1], generator=g)
        changed[k] = t
    t3 = time.perf_counter()
    s.put_tables(2, changed)
    t4 = time.perf_counter()
    stored = s.stats().stored_bytes if hasattr(s, "stats") else 0
    s.close()
    t5 = time.perf_counter()
    fresh = cnrstore.open(url, cache_dir=pathlib.Path(workdir) / "fresh",
                          storage_options=opts, decode_threads=threads)
    got = fresh.get_tables(2)
    t6 = time.perf_counter()
    assert all(torch.equal(got[k], changed[k]) for k in changed)
    fresh.close()
    return {"put_s": t1 - t0, "get_s": t2 - t1, "incr_put_s": t4 - t3,
            "cold_get_s": t6 - t5, "stored": stored}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=16, help="decode_threads on restore")
    ap.add_argument("--endpoint", help="an S3 endpoint (default: start weed mini here)")
    ap.add_argument("--bucket", default="cnr-bench")
    ap.add_argument("--out", default=None, help="directory for bench_s3.json")
    args = ap.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="cnr-bench-s3-")
    weed = None
    if args.endpoint is None:
        from _weed import Weed

        os.makedirs(os.path.join(workdir, "weed"))
        weed = Weed(os.path.join(workdir, "weed"))
        weed.bucket = args.bucket
        weed.start()
        endpoint = weed.endpoint
    else:
        endpoint = args.endpoint
    options = {"endpoint": endpoint, "access_key_id": os.environ.get("AWS_ACCESS_KEY_ID", "x"),
               "secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY", "x"),
               "region": os.environ.get("AWS_REGION", "us-east-1")}
    try:
        tables = make_tables(args.gb, args.tables)
        size = nbytes(tables)
        runs: dict[str, list[dict]] = {"torch_save": [], "cnr_s3": []}
        for r in range(args.repeat):
            runs["torch_save"].append(bench_torch_save(tables, options, args.bucket,
                                                       f"ts{r}", workdir))
            runs["cnr_s3"].append(bench_cnr(tables, options,
                                            f"s3://{args.bucket}/cnr{r}-{os.getpid()}",
                                            os.path.join(workdir, f"r{r}"), args.threads))
    finally:
        if weed is not None:
            weed.stop()
    med = {system: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
           for system, rs in runs.items()}
    mb = size / 1e6
    lines = [f"{mb:.0f} MB fp32 in {args.tables} tables, loopback S3 at {endpoint}, "
             f"median of {args.repeat}", "",
             "| system | put s | put MB/s | get s | get MB/s | other |",
             "|---|---|---|---|---|---|"]
    ts, cn = med["torch_save"], med["cnr_s3"]
    lines.append(f"| torch.save + obstore.put | {ts['put_s']:.2f} | {mb / ts['put_s']:.0f} | "
                 f"{ts['get_s']:.2f} | {mb / ts['get_s']:.0f} | save {ts['save_s']:.2f} s, "
                 f"upload {ts['upload_s']:.2f} s ({mb / ts['upload_s']:.0f} MB/s), download "
                 f"{ts['download_s']:.2f} s, load {ts['load_s']:.2f} s |")
    lines.append(f"| cnrstore on S3 | {cn['put_s']:.2f} | {mb / cn['put_s']:.0f} | "
                 f"{cn['get_s']:.2f} | {mb / cn['get_s']:.0f} | 5% incremental put "
                 f"{cn['incr_put_s']:.2f} s; empty-cache open + get {cn['cold_get_s']:.2f} s; "
                 f"stored {cn['stored'] / 1e6:.0f} MB |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_s3.json").write_text(json.dumps({"bytes": size, "runs": runs,
                                                       "median": med}, indent=1))
        (out / "bench_s3.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

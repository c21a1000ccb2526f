"""Subprocess worker: put one checkpoint step into a bucket store from its own cache.

    python _s3_ckpt_worker.py '<json>'  keys: url, cache, options, step, rows, go

Waits for the file ``go`` to exist, then puts ``step`` and prints ok or StepExists (or
ConcurrentCommit)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import cnrstore


def main() -> None:
    args = json.loads(sys.argv[1])
    store = cnrstore.open(args["url"], cache_dir=args["cache"],
                          storage_options=args["options"])
    table = torch.randn(args["rows"], 8, generator=torch.Generator().manual_seed(args["seed"]))
    print("ready", flush=True)
    while not os.path.exists(args["go"]):
        time.sleep(0.002)
    try:
        store.put_tables(args["step"], {"t": table})
    except cnrstore.StepExists:
        print("StepExists", flush=True)
    except cnrstore.ConcurrentCommit:
        print("ConcurrentCommit", flush=True)
    else:
        print("ok", flush=True)
    store.close()


if __name__ == "__main__":
    main()

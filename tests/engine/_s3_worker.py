"""Subprocess worker of the bucket-store tests: one writer on its own cache.

    python _s3_worker.py '<json>'   with keys url, cache, options, cmd and cmd's own keys

cmd "put": put ``count`` objects of ``size`` random bytes under root ``root``; with
``go`` (a file path), wait until that file exists before committing, so two workers
commit at the same moment. Prints one line: ok, RootExists or CommitSequenceTaken.
cmd "gc": delete root ``root`` (if given) and gc. Prints ok.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import engine  # noqa: E402


def main() -> None:
    args = json.loads(sys.argv[1])
    store = engine.storage_open(args["url"], cache_dir=args["cache"],
                                storage_options=args["options"],
                                pack_target_size=args.get("pack_target_size", 64 << 20))
    if args["cmd"] == "gc":
        if args.get("root"):
            with store.writer(timeout=30) as w:
                w.delete_root(args["root"])
        store.gc(threshold=0.0)
        print("ok", flush=True)
        return
    w = store.writer(timeout=30)
    try:
        # Leaves from a seeded generator: a check can recompute what a root must hold.
        rng = random.Random(args.get("seed", 0))
        leaves = [w.put(1, rng.randbytes(args["size"])) for _ in range(args["count"])]
        top = w.put(2, args["root"].encode(), leaves, meta=True)
        w.create_root(args["root"], top)
        print("ready", flush=True)
        go = args.get("go")
        while go and not os.path.exists(go):
            time.sleep(0.002)
        w.commit()
    except engine.RootExists:
        print("RootExists", flush=True)
        return
    except engine.CommitSequenceTaken:
        print("CommitSequenceTaken", flush=True)
        return
    except engine.StoreError as exc:  # a failed upload: the put fails whole
        w.abort()
        print(f"failed: {exc}".splitlines()[0], flush=True)
        sys.exit(3)
    print("ok", flush=True)
    store.close()


if __name__ == "__main__":
    main()

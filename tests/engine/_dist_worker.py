"""Worker processes of the distributed-commit tests (tests/engine/test_dist_procs.py).

``rank`` writes one rank's objects with a PackSink into reserved packs and prints its
sealed locations; ``coord`` is the coordinator: it reserves a range per rank, starts the
ranks as processes, adopts what they report and commits one step; ``read_tables`` restores
a checkpoint step through LocatedObjects (no LMDB). Each prints one flushed line per
milestone, so the parent knows how far it got before a SIGKILL.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from _helpers import DATA_KIND, NODE_KIND, make_payload  # noqa: E402

import engine  # noqa: E402
from engine.format.ids import object_id  # noqa: E402

SIZE = 8192


def say(msg: str) -> None:
    print(msg, flush=True)


def rank_objects(rank: int, step: int, n: int) -> list[tuple[int, bytes, tuple[bytes, ...]]]:
    """What rank ``rank`` writes at ``step``: ``n`` data leaves and one node over them.
    Leaf 0 is shared by every rank and step (dedup across sinks and commits)."""
    objs = []
    ids = []
    for k in range(n):
        seed = 7 if k == 0 else 10_000 * (step + 1) + 100 * rank + k
        payload = make_payload(seed, SIZE)
        objs.append((DATA_KIND, payload, ()))
        ids.append(object_id(DATA_KIND, (), payload))
    node = make_payload(10**9 + 1000 * step + rank, 64)
    objs.append((NODE_KIND, node, tuple(ids)))
    return objs


def _cmd_rank(path: str, start: str, stop: str, wire: str, rank: str, step: str, n: str) -> None:
    options = engine.EngineOptions.from_wire(json.loads(wire))
    sink = engine.PackSink(path, range(int(start), int(stop)), options)
    for kind, payload, refs in rank_objects(int(rank), int(step), int(n)):
        sink.put(kind, payload, refs, meta=kind == NODE_KIND)
    say("written")
    locs = sink.seal()  # crash points sink.after_pack_write / sink.after_seal
    say("sealed " + engine.encode_locations(locs).hex())


def _cmd_coord(path: str, ranks: str, step: str, n: str, rank_crash: str,
               gc_during: str = "no") -> None:
    """``rank_crash``: "-" or "RANK:POINT" (that rank SIGKILLs itself at POINT);
    ``gc_during`` "yes": another process runs gc after the ranks sealed, before adopt."""
    nranks = int(ranks)
    with engine.open(path) as store:
        per = 2  # one data pack and one meta pack per rank
        reserved = store.reserve_packs(per * nranks)
        say(f"reserved {reserved.start} {reserved.stop}")
        procs = []
        for r in range(nranks):
            env = dict(os.environ)
            env.pop("CNRSTORE_CRASH_AT", None)
            if rank_crash != "-" and int(rank_crash.split(":")[0]) == r:
                env["CNRSTORE_CRASH_AT"] = rank_crash.split(":", 1)[1]
            lo = reserved.start + per * r
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE), "rank", path, str(lo), str(lo + per),
                 json.dumps(store.options.to_wire()), str(r), step, n],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        locs = []
        failed = []
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=60)
            sealed = [ln for ln in out.splitlines() if ln.startswith("sealed ")]
            if p.returncode != 0 or not sealed:
                failed.append((r, p.returncode))
                continue
            locs.extend(engine.decode_locations(bytes.fromhex(sealed[0].split()[1])))
        if failed:
            store.release_packs(reserved)  # the put failed: its packs are orphans now
            say(f"failed {failed}")
            return
        say(f"gathered {len(locs)}")
        if gc_during == "yes":
            gc = subprocess.run([sys.executable, str(HERE.parent / "_helpers.py"), "gc", path,
                                 "0.0"], capture_output=True, text=True, timeout=60)
            say(f"other-gc rc={gc.returncode} {gc.stdout.strip()} {gc.stderr.strip()[-300:]}")
        w = store.writer(timeout=30)
        w.adopt(locs)  # crash point adopt.after_check
        say("adopted")
        tops = sorted({loc.oid for loc in locs if loc.kind == NODE_KIND})
        top = w.put(NODE_KIND, make_payload(10**8 + int(step), 64), tops, meta=True)
        w.create_root(f"r{step}", top)
        info = w.commit()  # writer.after_pack_fsync etc. apply here
        say(f"committed {step} {top.hex()} new={info.objects_new} reused={info.objects_reused}")


def _cmd_read_tables(path: str, locs_file: str, roots_file: str, out_file: str,
                     step: str) -> None:
    import msgpack
    import torch

    from cnrstore import CheckpointStore

    locs = engine.decode_locations(pathlib.Path(locs_file).read_bytes())
    roots = msgpack.unpackb(pathlib.Path(roots_file).read_bytes(), raw=False)
    with engine.LocatedReader(path) as reader:
        objects = engine.LocatedObjects(reader, {loc.oid: loc for loc in locs}, roots)
        cs = CheckpointStore(objects)
        tables = cs.get_tables(int(step))
        torch.save(tables, out_file)
    say(f"read {sorted(tables)}")
    from engine.index import db as index

    say(f"lmdb-envs {len(index._SHARED)}")  # a rank never opens the index


COMMANDS = {"rank": _cmd_rank, "coord": _cmd_coord, "read_tables": _cmd_read_tables}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](*sys.argv[2:])

"""Named points of the commit and gc protocols where crash tests kill the process.

Set ``CNRSTORE_CRASH_AT=name`` (or ``name:N`` to crash on the N-th hit, 1-based) in a
subprocess; when the engine reaches that point the process SIGKILLs itself, exactly as a
power cut or OOM kill would stop it. Unset, ``hit`` costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "writer.after_pack_write",    # records appended to the pack, not fsync'ed
    "writer.after_pack_fsync",    # packs sealed and fsync'ed, index not yet committed
    "writer.after_index_commit",  # index transaction committed (roots moved)
    "gc.after_mark",              # live set computed, nothing changed yet
    "gc.after_sweep_commit",      # dead entries removed from the index
    "gc.after_compact_write",     # new packs written and fsync'ed, index still old
    "gc.after_compact_commit",    # index points at the new packs, old packs still on disk
    "gc.after_delete",            # old pack files deleted
)

# The distributed commit's own points (docs/FORMAT.md "Distributed commit"); the writer's
# points above apply to the coordinator's commit too. Covered by tests/engine/test_dist*.
DIST_POINTS = (
    "sink.after_pack_write",      # a rank's records appended, its packs not sealed
    "sink.after_seal",            # a rank's packs sealed and fsync'ed, not yet reported
    "adopt.after_check",          # coordinator checked the adopted records, nothing published
)

# Points only a bucket store reaches (tests/engine/test_s3_crash.py kills there).
REMOTE_POINTS = (
    "s3.after_upload",             # one pack uploaded (a commit's others not yet)
    "writer.after_remote_commit",  # commit object created, the cache not yet updated
)

_counts: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("CNRSTORE_CRASH_AT")
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    return name, int(nth or 1)


def hit(name: str) -> None:
    """Called by the engine at each named point; kills the process if asked to."""
    target = _target()
    if target is None or target[0] != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] >= target[1]:
        os.kill(os.getpid(), signal.SIGKILL)

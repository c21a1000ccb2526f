"""The get pipeline of a store handle (CheckpointStore.get_tables; get_state and
load_state in statestore.py build on it): check the request, resolve the step, read the
tables it names (restore.py decodes), and seed the diff bases of the tables restored
whole (seed.seed_later), so a restarted job's next put is incremental again."""

from __future__ import annotations

import math
from typing import Any

from cnrstore.core.handle import HandleState
from cnrstore.core.progress import Reporter, check_progress
from cnrstore.core.restore import check_slice, read_tables
from cnrstore.core.seed import seed_later
from cnrstore.core.tablestate import parse_dtype
from cnrstore.core.validate import check_device, check_selection
from cnrstore.errors import StepNotFound, TableNotFound
from cnrstore.format.load import load_manifest
from cnrstore.format.manifest import root_name
from engine import StoreError

__all__ = ["get_tables", "out_bytes"]


def get_tables(core: HandleState, step: int | None, *, names: Any, rows: Any,
               device: Any, progress: Any = None) -> dict:
    core.check_open()
    check_progress(progress)
    if step is None:
        return core.latest(None, lambda s: get_tables(core, s, names=names, rows=rows,
                                                      device=device, progress=progress))
    names, rows = check_selection(names, rows)
    device = check_device(device)
    step = core.resolve_step(step)
    try:
        return _read_step(core, step, names, rows, device, progress)
    except StoreError as exc:
        # Another handle or process deleted the step and a gc swept its objects while they
        # were read: the step is gone, not damaged (the engine's ObjectNotFound escaped).
        if not _step_still_there(core.objects, step):
            raise StepNotFound(step, f"step {step} was deleted while it was read") from exc
        raise


def _read_step(core: HandleState, step: int, names: Any, rows: dict, device: Any,
               progress: Any = None) -> dict:
    manifest = load_manifest(core.objects, step, names=names)
    for name, sel in rows.items():
        if name not in manifest.tables:
            raise TableNotFound(name, step)
        check_slice(sel, manifest.tables[name].node.rows, name=name)
    out = {}
    seeds = []
    wanted = list(manifest.tables.items())
    report = Reporter(progress, sum(out_bytes(tm, rows.get(n)) for n, tm in wanted),
                      min_total=core.options.progress_min_bytes)
    tensors = read_tables(core.objects, core.pool, [(tm, rows.get(n)) for n, tm in wanted],
                          device, done=report.add if report.fn is not None else None)
    report.finish()
    for (name, tm), tensor in zip(wanted, tensors):
        if rows.get(name) is None and core.wants_seed(name):
            seeds.append((name, tm))
        out[name] = tensor
    # The diff bases of the restored tables are computed from the stored step after the
    # restore returns (seed.seed_later); the next put of a table waits for its own.
    for name, tm in seeds:
        core.seed(name, tm, None, None, (root_name(step), manifest.oid),
                  deferred=seed_later(core.objects, tm))
    return out


def out_bytes(tm: Any, sel: slice | None) -> int:
    """Bytes of the tensor a read of ``tm`` (rows ``sel``) returns."""
    node = tm.node
    rows = node.rows if sel is None else len(range(*sel.indices(node.rows)))
    return rows * math.prod(node.shape[1:]) * parse_dtype(node.dtype).itemsize


def _step_still_there(objects: Any, step: int) -> bool:
    """False when ``step`` was dropped (by another process) after it was resolved."""
    try:
        return objects.root(root_name(step)) is not None
    except StoreError:
        return True

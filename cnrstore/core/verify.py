"""Integrity check of a checkpoint store: the one implementation behind
``CheckpointStore.verify`` and ``cnrstore verify``.

The engine's check runs first (structure; with ``deep`` a re-hash of every object), then the
manifest of every step asked for is decoded and, with ``deep``, every block's patch chain is
resolved and its shape checked against the geometry of EVERY table that refers to it (a
crafted table node may list a small block as a huge one); a block is decoded once however
many tables refer to it, and each object of a chain once however many steps' chains
run through it (each step's patch sits on the last: resolving every chain from its full
block read steps x depth objects, tests/cnrstore/test_verify_cost.py). Problems are
engine ``Problem`` records, those of this layer ``StepProblem`` records that also say the
step, table and block. A step that is gone when it is read (dropped by a gc in another
process since it was listed) is not a problem.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cnrstore.core.options import OPTIONS_ROOT, read_stored
from cnrstore.errors import CheckpointError, ManifestError, StepNotFound
from cnrstore.format.blocks import (
    KIND_BLOCK_FULL,
    KIND_BLOCK_LIST,
    KIND_BLOCK_PATCH,
    MAX_CHAIN,
    decode_full,
    decode_patch,
    plan_chain,
)
from cnrstore.format.load import list_steps, load_manifest
from cnrstore.format.manifest import StepManifest, root_name
from cnrstore.format.rowlists import decode_rows_object, read_list
from engine import ObjectStore, Problem, StoreError
from engine.api import ProgressFn

__all__ = ["StepProblem", "VerifyResult", "verify_objects"]


@dataclass(frozen=True)
class StepProblem(Problem):
    """A problem the checkpoint layer found: an engine Problem plus where it is."""

    step: int | None = None
    table: str | None = None
    block: int | None = None


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    problems: tuple[Problem, ...]
    steps_checked: int
    objects_checked: int
    bytes_checked: int
    blocks_decoded: int
    blocks_checked: int = 0  # distinct blocks tried (decoded or not)


def verify_objects(objects: ObjectStore, *, deep: bool = True,
                   steps: Iterable[int] | None = None,
                   progress: ProgressFn | None = None) -> VerifyResult:
    """Verify the store ``objects``: all steps, or those in ``steps`` (StepNotFound if one
    is missing). ``progress(done, total)`` hears of the engine's pass, then of the blocks."""
    have = list_steps(objects)
    if steps is None:
        chosen, roots = have, None
    else:
        chosen = sorted(set(steps))
        for s in chosen:
            if s not in have:
                raise StepNotFound(s)
        roots = [root_name(s) for s in chosen]
    report = objects.verify(deep=deep, roots=roots, progress=progress)
    problems: list[Problem] = list(report.problems)
    try:
        read_stored(objects)
    except (CheckpointError, StoreError) as exc:
        problems.append(StepProblem("bad-options", f"{OPTIONS_ROOT}: {type(exc).__name__}: "
                                    f"{exc}", oid=getattr(exc, "oid", None)))
    manifests: list[tuple[int, StepManifest]] = []
    for step in chosen:
        try:
            manifest = load_manifest(objects, step)
        except (CheckpointError, StoreError) as exc:
            if _still_there(objects, step):
                problems.append(StepProblem("bad-manifest", f"step {step}: "
                                            f"{type(exc).__name__}: {exc}",
                                            oid=getattr(exc, "oid", None), step=step))
            continue
        if manifest.node.step != step:
            problems.append(StepProblem("bad-manifest", f"step {step}: root holds the step "
                                        f"node of step {manifest.node.step}",
                                        oid=manifest.oid, step=step))
        manifests.append((step, manifest))
    shapes: dict[bytes, tuple[int, ...] | None] = {}  # decoded shape; None: undecodable
    if deep:
        problems += _check_blocks(objects, manifests, shapes, progress, {})
    decoded = sum(1 for s in shapes.values() if s is not None)
    return VerifyResult(not problems, tuple(problems), len(chosen), report.objects_checked,
                        report.bytes_checked, decoded, len(shapes))


def _check_blocks(objects: ObjectStore, manifests: list[tuple[int, StepManifest]],
                  shapes: dict[bytes, tuple[int, ...] | None],
                  progress: ProgressFn | None, checked: dict[bytes, _Checked]
                  ) -> list[Problem]:
    problems: list[Problem] = []
    total = sum(len(tm.block_ids) for _, m in manifests for tm in m.tables.values())
    done = 0
    for step, manifest in manifests:
        for name, tm in manifest.tables.items():
            for i, oid in enumerate(tm.block_ids):
                done += 1
                if progress is not None and (done % 64 == 0 or done == total):
                    progress(done, total)
                where = f"step {step} table {name!r} block {i} ({oid.hex()})"
                start, stop = tm.node.block_range(i)
                if oid not in shapes:
                    try:
                        shapes[oid] = _chain_shape(objects, oid,
                                                   (stop - start, tm.node.row_nbytes), checked)
                    except (CheckpointError, StoreError) as exc:
                        shapes[oid] = None
                        if not _still_there(objects, step):
                            break  # dropped by a gc in another process since it was listed
                        problems.append(StepProblem("bad-block", f"{where}: "
                                                    f"{type(exc).__name__}: {exc}", oid=oid,
                                                    step=step, table=name, block=i))
                        continue
                shape, want = shapes[oid], (stop - start, tm.node.row_nbytes)
                if shape is not None and shape != want:
                    problems.append(StepProblem("bad-block", f"{where}: holds {shape} codes, "
                                                f"expected {want}", oid=oid, step=step,
                                                table=name, block=i))
    return problems


# A chain's shape, or its error; for a row object, its shape, entry and rows (_list_shape).
_Checked = tuple | CheckpointError | StoreError


def _chain_shape(objects: ObjectStore, oid: bytes, want: tuple[int, int],
                 checked: dict[bytes, _Checked]) -> tuple[int, int]:
    """The codes' shape of block ``oid``, with the checks of ``blocks.resolve`` (the chain's
    sizes from the index first, then every object decoded, every patch of its base's
    shape), but an object whose chain ``checked`` already holds is not read again."""
    plan_chain(objects.info, oid, *want)
    pending: list[tuple[bytes, tuple[int, int]]] = []
    cur = oid
    while cur not in checked:
        try:
            obj = objects.get(cur)
            if obj.kind == KIND_BLOCK_LIST and cur == oid:
                checked[cur] = _list_shape(objects, obj, oid, want, checked)
                break
            if obj.kind == KIND_BLOCK_FULL:
                checked[cur] = decode_full(obj, cur).shape
                break
            if obj.kind != KIND_BLOCK_PATCH or len(obj.refs) != 1:
                raise ManifestError(f"object kind {obj.kind} is not a block", oid=cur)
            head, _, _ = decode_patch(obj, cur)
        except (CheckpointError, StoreError) as exc:
            checked[cur] = exc
            break
        pending.append((cur, (head.nrows, head.row_nbytes)))
        if len(pending) > MAX_CHAIN:
            raise ManifestError("patch chain too deep (cycle?)", oid=oid)
        cur = obj.refs[0]
    base = checked[cur]
    for poid, shape in reversed(pending):  # oldest first, as resolve applies them
        if not isinstance(base, Exception) and shape != base:
            base = ManifestError("patch does not match its base block's shape", oid=poid)
        checked[poid] = base
    if isinstance(base, Exception):
        raise base
    return base


def _list_shape(objects: ObjectStore, node, oid: bytes, want: tuple[int, int],
                checked: dict[bytes, _Checked]) -> tuple[int, int]:
    """The shape of a grouped block version: every listed row object decoded once (its
    ids ascending and inside the block, its class, rows and step those of its entry),
    and together they hold a copy of every row of the block (a delta's through its base,
    which is checked a full list)."""
    entries = read_list(objects.get, oid, node)
    refs, cls, counts, steps = entries.refs, entries.cls, entries.rows, entries.steps
    covered = np.zeros(want[0], dtype=bool)
    for k, ref in enumerate(refs):
        got = checked.get(ref)
        if got is None:
            try:
                part = objects.get(ref)
                head, idx, _, _ = decode_rows_object(part, ref)
            except (CheckpointError, StoreError) as exc:
                checked[ref] = exc
                raise
            # (shape, entry, rows: a span or the ids), kept for the lists that share it
            got = checked[ref] = (head.nrows, head.row_nbytes, head.count, head.cls,
                                  head.step,
                                  (head.start, head.start + head.count) if idx is None else idx)
        if isinstance(got, Exception):
            raise got
        if got[:2] != want or got[2:5] != (counts[k], cls[k], steps[k]):
            raise ManifestError(f"row object {ref.hex()} does not match its list entry "
                                "or block", oid=oid)
        at = got[5]
        if isinstance(at, tuple):
            covered[at[0]:at[1]] = True
        else:
            covered[at] = True
    if not covered.all():
        raise ManifestError(f"block list leaves {int((~covered).sum())} rows with no copy",
                            oid=oid)
    return want


def _still_there(objects: ObjectStore, step: int) -> bool:
    """False when ``step`` was dropped (by another process) after verify listed it."""
    try:
        return objects.root(root_name(step)) is not None
    except StoreError:
        return True

"""Integrity checks of a store: the engine's verify plus the checkpoint layer's own.

``verify`` runs the engine's check (structure; with ``deep`` a re-hash of every object),
then decodes the manifests of the steps asked for and, with ``deep``, resolves every
block's patch chain against its table's geometry. Problems are engine ``Problem`` records
(what, message, object id, pack, offset), so both layers report alike. ``repair`` rebuilds
the engine index from the packs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import engine
from cnrstore.errors import ManifestError
from cnrstore.format.manifest import load_step, load_table_manifest, root_name
from cnrstore.tools.access import opened, selected_steps, tick
from engine import Problem
from engine.api import ProgressFn

__all__ = ["VerifyResult", "verify", "repair"]


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    problems: tuple[Problem, ...]
    steps_checked: int
    objects_checked: int
    bytes_checked: int
    blocks_decoded: int


def verify(store, *, deep: bool = False, steps: Iterable[int] | None = None,
           progress: ProgressFn | None = None) -> VerifyResult:
    """Check the engine (structure; with ``deep`` re-hash every object) and then the
    manifests of the steps: nodes decode, block counts match shapes, and with ``deep``
    every block's chain resolves to codes of the table's geometry. ``progress`` hears of
    the engine's pass, then of the blocks decoded."""
    from cnrstore.format.blocks import read_header, resolve

    with opened(store) as objects:
        chosen = selected_steps(objects, steps)
        roots = None if steps is None else [root_name(s) for s in chosen]
        report = objects.verify(deep=deep, roots=roots, progress=progress)
        problems = list(report.problems)
        checked: set[bytes] = set()
        decoded = 0
        manifests = []
        for step in chosen:
            try:
                _, node = load_step(objects, step)
                tables = [load_table_manifest(objects, t) for t in node.table_ids]
            except (ManifestError, engine.StoreError) as exc:
                problems.append(Problem("bad-manifest", f"step {step}: {exc}",
                                        oid=getattr(exc, "oid", None)))
                continue
            manifests.append((step, tables))
        total = sum(len(tm.block_ids) for _, tables in manifests for tm in tables) if deep else 0
        done = 0
        for step, tables in manifests if deep else ():
            for tm in tables:
                for i, bid in enumerate(tm.block_ids):
                    done += 1
                    if done % 64 == 0 or done == total:
                        tick(progress, done, total)
                    if bid in checked:
                        continue
                    checked.add(bid)
                    start, stop = tm.node.block_range(i)
                    where = f"step {step} table {tm.node.name!r} block {i}"
                    try:
                        read_header(objects.get(bid), bid)
                        codes = resolve(objects.get, bid)
                    except (ManifestError, engine.StoreError) as exc:
                        problems.append(Problem("bad-block", f"{where}: {exc}", oid=bid))
                        continue
                    decoded += 1
                    if codes.shape != (stop - start, tm.node.row_nbytes):
                        problems.append(Problem(
                            "bad-block", f"{where} holds {codes.shape} codes, expected "
                            f"{(stop - start, tm.node.row_nbytes)}", oid=bid))
        return VerifyResult(not problems, tuple(problems), len(chosen),
                            report.objects_checked, report.bytes_checked, decoded)



def repair(path: str | os.PathLike) -> engine.RepairReport:
    """Rebuild the index of the store at ``path`` from its packs (engine.repair)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no store at {os.fspath(path)!r}")
    with engine.open(path, create=False) as objects:
        return objects.repair()

"""Where a world of one plans a put: every table whole, on this process (the put
pipeline's ``Placement`` for CheckpointStore; core/put.py. Many ranks place blocks on the
global row grid instead: cnrstore/distributed/put.py).

Checks everything before anything is written (docs/GUIDE.md, "The API contract"), and
takes each table's diff base from the handle, checked against the store (another
process may have dropped its anchor), or seeds it from the newest stored step holding
the table (core/seed.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from cnrstore.core.progress import check_progress
from cnrstore.core.put import Request, Work, check_new_step, forget_failed
from cnrstore.core.seed import seed_state
from cnrstore.core.tablestate import TableState
from cnrstore.core.validate import (
    check_step,
    check_tables,
    check_touched,
    check_writable,
    pack_metadata,
    resolve_quant,
)
from cnrstore.format.manifest import check_step_fits

__all__ = ["WholeTables"]


class WholeTables:
    """Each table one run of all its blocks, keyed by its name; the run's rows are the
    caller's tensor itself (planned, or borrowed by a blocking put, with no copy)."""

    def prepare(self, h: Any, step: int, tables: Mapping, *, quant: Any,
                metadata: Mapping | None, touched: Mapping | None, state: dict | None,
                progress: Any) -> Request:
        check_writable(h.objects, "put_tables")
        check_step(step)
        check_tables(tables)
        check_progress(progress)
        schemes = resolve_quant(quant, tables, expected_restores=h.options.expected_restores)
        meta_doc = pack_metadata(metadata)
        check_step_fits(step, list(tables), meta_doc, state)  # docs/MANIFEST.md "Memory caps"
        rows_touched = check_touched(touched, tables)
        forget_failed(h, h.objects.has)
        check_new_step(h.objects, h.pending, step)
        rows = h.options.rows
        works = [Work(name, name, 0, -(-int(t.shape[0]) // rows), 0,
                      t.numel() * t.element_size(), t, None, rows_touched.get(name))
                 for name, t in tables.items()]
        return Request(works, schemes, meta_doc, dict(tables), time.perf_counter())

    def bases(self, h: Any, req: Request) -> dict[Any, TableState | None]:
        roots: dict[str, bytes | None] = {}

        def root(name: str) -> bytes | None:  # one lookup per anchor step per put
            if name not in roots:
                roots[name] = h.objects.root(name)
            return roots[name]

        out: dict[Any, TableState | None] = {}
        opt = h.options
        for w in req.works:
            base = h.states.get(w.name)
            if base is not None:
                base.revalidate(root, h.objects.has)
            elif opt.seed_from_store:
                # Diff base of a table's first put in this handle: the newest stored
                # step that holds it with the same geometry and encoding.
                h.writer.drain()
                base = seed_state(h.objects, w.name, req.tables[w.name], req.schemes[w.name],
                                  block_rows=opt.rows, fanout=opt.segment_fanout,
                                  pool=h.pool)
            out[w.name] = base
        return out

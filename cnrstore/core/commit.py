"""How a world of one commits a put: the engine writer, directly (the put pipeline's
``Commit`` for CheckpointStore; core/put.py. Many ranks commit through the coordinator:
cnrstore/distributed/commit.py).

The step is written on the handle's writer thread in one engine transaction
(core/writer.py ``write_step``), under the writer lock that also checks the step order
and the stored options. Because this process can read the store, a put keeps every
row's codes when its diff base may be dropped by a gc in another process before the
writer lock is held (``at_risk``, issue 8), a blocking put borrows the caller's tables
(no copy), and a non-blocking put defers the encoding to the writer thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cnrstore.core import lineage
from cnrstore.core.options import ensure_stored
from cnrstore.core.put import Plans, Request
from cnrstore.core.tablestate import TableState
from cnrstore.core.writer import StepInfo, write_step
from cnrstore.errors import StepExists, StepOrderError, WriteFailed
from cnrstore.format.load import list_steps
from cnrstore.format.manifest import root_name

__all__ = ["EngineCommit"]


class EngineCommit:
    """The step written by this process's engine writer."""

    def plan_options(self, h: Any, req: Request, *, blocking: bool, keep_full: bool
                     ) -> list[dict]:
        newest: list[str] = []

        def at_risk(base: TableState | None) -> bool:
            # A base on a step that will not be the newest when this put is written
            # may be dropped by another process's gc before the writer holds the
            # lock (issue 8); a base on a pending put has no anchor yet.
            if base is None:
                return False
            if keep_full:
                return True
            anchor = base.anchor[0] if base.anchor else base.planned_root
            # Even this handle's latest put is checked: another process may have put
            # a newer step since, and a gc keeping that one drops ours (issue 8).
            if not newest:
                steps = list_steps(h.objects) + list(h.pending)
                newest.append(root_name(max(steps)) if steps else "")
            return anchor != newest[0]

        # a non-blocking tracked put plans on the writer thread, where a grouped cleaner
        # reads the unchanged rows it writes again from the store (writerplan.py)
        objects = None if blocking else h.objects
        return [{"keep_full": at_risk(req.bases.get(w.key)), "borrow": blocking,
                 "defer_encode": not blocking, "store_objects": objects} for w in req.works]

    def known_widths(self, h: Any, req: Request) -> None:
        return None  # a world of one: its width "round" is free, its errors raise at once

    def job(self, h: Any, step: int, req: Request, plans: Plans, widths: dict[str, int],
            stall: float, state: dict | None, error: BaseException | None = None
            ) -> Callable[[], StepInfo]:
        assert error is None  # known_widths gives none, so planning errors raise here
        planned = [p for _, _, p in plans]
        return lambda: _write(h, step, planned, req.meta_doc, stall, state)


def _write(h: Any, step: int, plans: list, metadata: dict, stall: float,
           state: dict | None) -> StepInfo:
    order = lineage.commit_check(h.objects, step)

    def check(w) -> None:  # under the engine's writer lock, in the step's transaction
        order()
        ensure_stored(h.objects, w, h.options)

    try:
        for p in plans:  # a non-blocking put's deferred encodes, before the writer lock
            p.encoded()
        return write_step(h.objects, step, plans, metadata=metadata, stall_seconds=stall,
                          lock_timeout=h.options.lock_timeout, state=state, check=check)
    except BaseException as exc:
        if isinstance(exc, (WriteFailed, StepOrderError, StepExists)):
            raise
        raise WriteFailed(step, f"{type(exc).__name__}: {exc}") from exc

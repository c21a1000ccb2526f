"""The whole-training-state and lineage methods of CheckpointStore (issue 10), kept apart
from store.py so the handle's core (put, get, lifetime) stays one readable module. The
work is done in statestore.py and lineage.py; this is their public face."""

from __future__ import annotations

from collections.abc import Mapping

from cnrstore.core import lineage, statestore
from cnrstore.errors import translating

__all__ = ["StateMethods"]


class StateMethods:
    """put_state / get_state / load_state / rollback; mixed into CheckpointStore."""

    @translating
    def put_state(self, step: int, state, *, quant=None, metadata: Mapping | None = None,
                  blocking: bool = True, touched: Mapping | None = None):
        """Store a training state as ``step``: any nesting of dicts (str or int keys),
        lists and tuples, e.g. ``{"model": m.state_dict(), "optim": opt.state_dict(),
        "epoch": 3}``. Tensor leaves (any ndim) become tables named by their path joined
        with "/" (``model/emb.weight``, ``optim/state/0/sum``); Python leaves (None, bool,
        int, float, str, bytes) go into the step node. ``quant`` maps fnmatch patterns over
        those names to schemes (a scheme string means ``{"*": scheme}``); tensors of ndim
        < 2 stay exact. Otherwise like ``put_tables`` (StepInfo, or a Future of it)."""
        return statestore.put_state(self, step, state, quant=quant, metadata=metadata,
                                    blocking=blocking, touched=touched)

    @translating
    def get_state(self, step: int | None = None, *, device="cpu"):
        """The nesting put with ``step`` (None: the highest), with fresh tensors on
        ``device``; key types, lists, tuples and dict order as put. A put_tables step
        gives its tables."""
        return statestore.get_state(self, step, device=device)

    @translating
    def load_state(self, step: int | None, state, *, strict: bool = True):
        """Restore ``step`` (None: the highest) into the tensors of ``state`` in place (no
        second copy of a table) and return ``state`` with its Python leaves as stored.
        Every name, shape and dtype is checked before any tensor is written; entries the
        step lacks are an error, skipped with ``strict=False``; stored entries ``state``
        does not name are left alone."""
        return statestore.load_state(self, step, state, strict=strict)

    @translating
    def rollback(self, step: int) -> list[int]:
        """Delete every step after ``step`` in one atomic commit, so ``step`` is the latest
        again and the next put (which must be above it) is incremental against it. Returns
        the deleted steps; StepNotFound if ``step`` does not exist. gc reclaims the bytes."""
        return lineage.rollback(self, step)

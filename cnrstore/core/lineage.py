"""Lineage of a store: "latest" is the highest step, steps only grow, and going back to an
older step is an explicit ``rollback`` (docs/GUIDE.md, "Training state and lineage";
docs/design/training-state.md).

Resuming from step 100 while steps up to 300 exist used to add step 150 below 300: reads
of "latest" still saw 300 and ``gc(keep_last=2)`` dropped the new step. Now a put below the
highest step is refused (StepOrderError), up front and again under the engine's writer
lock at commit (another process may have committed a higher step meanwhile), and
``rollback(100)`` deletes the later steps in one engine commit first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cnrstore.core.handle import HandleState
from cnrstore.core.validate import check_step
from cnrstore.errors import InvalidType, StepNotFound, StepOrderError
from cnrstore.format.load import list_steps
from cnrstore.format.manifest import root_name
from engine import ObjectStore

__all__ = ["commit_check", "rollback", "delete_steps"]


def commit_check(objects: ObjectStore, step: int) -> Callable[[], None]:
    """The order rule (checked up front by put.check_new_step), for write_step to run once
    the writer lock is held."""

    def check() -> None:
        steps = list_steps(objects)
        if steps and steps[-1] > step:
            raise StepOrderError(step, steps[-1])

    return check


def _forget_bases(core: HandleState) -> None:
    # The handle's diff bases describe the rolled-back (or deleted) branch; the next put
    # seeds from the newest stored step (seed_from_store) or a restore seeds it.
    with core.lock:
        core.states.clear()


def rollback(core: HandleState, step: int) -> list[int]:
    """Delete every step after ``step`` in one engine commit; return them (ascending)."""
    core.check_open()
    check_step(step)
    objects = core.objects

    def job() -> list[int]:
        with objects.writer(timeout=core.options.lock_timeout) as w:
            if objects.root(root_name(step)) is None:
                raise StepNotFound(step)
            later = [s for s in list_steps(objects) if s > step]
            for s in later:
                w.delete_root(root_name(s))
        return later

    with core.lock:
        core.wait_step(step)
        deleted = core.writer.run(job)  # after every put queued before it
        if deleted:  # nothing deleted: the bases describe ``step`` or an older one
            _forget_bases(core)
    return deleted


def delete_steps(core: HandleState, steps: Iterable[int]) -> list[int]:
    """Delete the named steps in one engine commit (all or none: StepNotFound if any is
    missing). Returns them sorted. Their bytes are reclaimed by the next gc."""
    core.check_open()
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
        raise InvalidType("steps must be an iterable of steps")
    wanted = sorted({check_step(s) for s in steps})
    objects = core.objects

    def job() -> list[int]:
        with objects.writer(timeout=core.options.lock_timeout) as w:
            for s in wanted:
                if objects.root(root_name(s)) is None:
                    raise StepNotFound(s)
            for s in wanted:
                w.delete_root(root_name(s))
        return wanted

    with core.lock:
        for s in wanted:
            core.wait_step(s)
        return core.writer.run(job)

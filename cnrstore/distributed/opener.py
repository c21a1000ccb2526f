"""``cnrstore.open``: one entry point that picks the kind of store from its arguments.

Without ``group`` it is ``cnrstore.core.store.open`` (a plain store, exactly as before);
with ``group`` (a torch.distributed process group) it opens a ``DistributedStore``
collectively; ``s3://`` locations and shared directories (``cache_dir=``) work both ways
(cnrstore/core/location.py picks the engine store on the opening process).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from cnrstore.core.options import Options

__all__ = ["open"]


def _opener(path: str | os.PathLike, group: Any) -> Callable[..., Any]:
    """The function that opens ``path`` (a seam: one branch per kind of store)."""
    if group is not None:
        from cnrstore.distributed.store import open_distributed

        return open_distributed
    from cnrstore.core.store import open as open_plain

    return open_plain


def open(  # noqa: A001 - the public name is cnrstore.open
    path: str | os.PathLike,
    options: Options | None = None,
    *,
    group: Any = None,
    **kwargs: Any,
) -> Any:
    """Open (creating it if missing) the checkpoint store at ``path``.

    Without ``group``: a ``CheckpointStore`` (cnrstore/core/store.py lists the keyword
    arguments). With ``group`` (a torch.distributed process group, e.g.
    ``dist.group.WORLD``): a ``DistributedStore``, opened collectively by every rank of
    the group; ``timeout=`` (seconds, default 300) bounds each of its collectives."""
    if group is not None:
        return _opener(path, group)(path, options, group=group, **kwargs)
    return _opener(path, group)(path, options, **kwargs)

"""Reading one stored block's codes: the block and its patch chain resolved at the
locations one index read found, checked against the block's rows, into a caller's buffer
or a per-thread scratch one.

This is the unit every restore path decodes from (cnrstore/core/restore.py's table reads,
the in-place ``read_into``, seeding a diff base); it is apart from restore.py because it
is about one block's bytes and where they are, not about assembling tables.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cnrstore.errors import CorruptData, ManifestError
from cnrstore.format.blocks import resolve
from cnrstore.format.manifest import TableManifest
from engine import CorruptObject, Object, ObjectNotFound, ObjectStore, StoreClosed, StoreError

__all__ = ["Located", "block_codes", "codes_buffer"]


def block_codes(
    objects: ObjectStore, tm: TableManifest, i: int, out: np.ndarray | None = None,
    located: Located | None = None,
) -> np.ndarray:
    """Block ``i`` of ``tm`` resolved (into ``out`` when given). ``located``: the
    locations and the patches already read of the window this block is read in
    (cnrstore/core/windowread.py); otherwise the block's chain is located here."""
    node = tm.node
    oid = tm.block_ids[i]
    start, stop = node.block_range(i)
    reads = _chain_reads(objects, oid, located)
    get, get_into, info, get_many = (reads if reads is not None else (
        objects.get, objects.get_into, objects.info, lambda o: list(objects.get_many(o))))
    try:
        # The chain's sizes are checked in the index against the block's rows first: a
        # crafted record that zstd expands to a gigabyte is refused before it is read.
        # A grouped block's row objects are read together (get_many).
        codes = resolve(get, oid, out=out, get_into=get_into, info=info,
                        shape=(stop - start, node.row_nbytes), get_many=get_many)
    except (CorruptObject, ObjectNotFound, CorruptData) as exc:
        # Name the table and block: after a repair that kept a damaged step, this is how
        # a user learns which table lost what (the type stays, for the callers' checks).
        if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith("table "):
            exc.args = (f"table {node.name!r} block {i} (rows {start}..{stop - 1}): "
                        f"{exc.args[0]}", *exc.args[1:])
        raise
    if codes.shape != (stop - start, node.row_nbytes):
        raise ManifestError(
            f"table {node.name!r} block {i} holds {codes.shape} codes, expected "
            f"{(stop - start, node.row_nbytes)}",
            oid=oid,
        )
    return codes


_scratch = threading.local()
_SCRATCH_KEEP = 64 << 20  # larger block buffers are not kept between blocks


def codes_buffer(node, i: int) -> np.ndarray | None:
    """A C-contiguous uint8 [rows of block i, row_nbytes] buffer of this thread, reused
    from block to block: a lossy block's codes are read into it (no fresh buffer, no
    copy of the record) and decoded from it before the thread's next block. None for a
    block claiming more than _SCRATCH_KEEP bytes: then the record's own size is read
    first (a crafted node must not make a restore allocate what it claims)."""
    start, stop = node.block_range(i)
    want = (stop - start) * node.row_nbytes
    if want > _SCRATCH_KEEP:
        return None
    buf = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < want:
        buf = np.empty(want, dtype=np.uint8)
        _scratch.buf = buf
    return buf[:want].reshape(stop - start, node.row_nbytes)


# (locations found in one index read, checked patch records already read by location)
Located = tuple[dict[bytes, Any], dict[bytes, Object]]


def _chain_reads(objects: ObjectStore, oid: bytes, located: Located | None = None
                 ) -> tuple[Callable, Callable, Callable, Callable] | None:
    """(get, get_into, info, get_many) reading block ``oid`` and its patch chain (or its
    list's row objects, ``get_many`` reading those together) at the locations one
    ``locate_closure`` (one read transaction) found when the block's read starts: a
    block and its ~3 patches otherwise cost an index lookup each. None where the store
    cannot locate (then the reads look up as before). Located per block (or per window
    of a few blocks), not per table: a step deleted and swept before a block's read
    begins still reads as gone. A patch in ``located`` is the record read there, with
    every check of ``get_at``."""
    pre: dict[bytes, Object] = {}
    if located is not None:
        found, pre = located
    else:
        try:
            found = objects.locate_closure([oid])
        except StoreClosed:
            raise
        except StoreError:  # no locations here (or a damaged entry: the reads report it)
            return None

    def get(oid: bytes) -> Object:
        obj = pre.get(oid)
        if obj is not None:
            return obj
        loc = found.get(oid)
        return objects.get(oid) if loc is None else objects.get_at(loc)

    def get_into(oid: bytes, kind: int, prefix: int, out: memoryview, *,
                 id_check: bool = True, fallback: bool = False) -> bytes | Object | None:
        obj = pre.get(oid)
        if obj is not None and fallback:  # a patch: what the fallback read returns
            return obj
        loc = found.get(oid)
        if loc is None:
            return objects.get_into(oid, kind, prefix, out, id_check=id_check,
                                    fallback=fallback)
        return objects.get_into_at(loc, kind, prefix, out, id_check=id_check,
                                   fallback=fallback)

    def info(oid: bytes) -> Any:
        loc = found.get(oid)
        return objects.info(oid) if loc is None else loc

    def get_many(oids: Sequence[bytes]) -> list[Object]:
        todo = [found[o] for o in dict.fromkeys(oids) if o not in pre and o in found]
        got = dict(zip((loc.oid for loc in todo), objects.get_many_at(todo)))
        return [pre.get(o) or got.get(o) or objects.get(o) for o in oids]

    return get, get_into, info, get_many

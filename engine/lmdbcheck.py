"""Checks of an LMDB data file made with plain reads, before LMDB maps it.

LMDB maps data.mdb and trusts the page numbers in it: a file shorter than its newest meta
page says (truncated, or a foreign file) makes the first access past the end kill the
process with SIGBUS. So the two meta pages are checked before LMDB ever sees the file
(docs/FORMAT.md "Index freshness"). Offsets are those of LMDB 0.9 on 64-bit platforms.
"""

from __future__ import annotations

import os
import pathlib
import struct

import lmdb

from .errors import FormatError

_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_META = struct.Struct("<IIQQ")   # magic, version, address, mapsize at page offset 16
_LMDB_PSIZE = struct.Struct("<I")     # md_pad of the free-list db: the page size, offset 40
_LMDB_LAST = struct.Struct("<QQ")     # last page number, txn id, at page offset 136
_META_END = 152                       # bytes of a meta page this check reads


class DamagedIndex(FormatError):
    """data.mdb is truncated, not an LMDB file, or LMDB found its pages corrupted: the
    index must be rebuilt from the packs (a writable open does so by itself)."""


# What LMDB reports for pages it cannot make sense of (as opposed to resource errors).
CORRUPTION = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError,
              lmdb.BadTxnError, lmdb.PanicError, lmdb.VersionMismatchError,
              lmdb.BadValsizeError, lmdb.IncompatibleError, lmdb.BadDbiError)


def data_file_problem(data: pathlib.Path) -> str | None:
    """Why ``data.mdb`` must not be handed to LMDB, or None (also for a missing file)."""
    try:
        with open(data, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            pages = [f.read(_META_END)]
            if len(pages[0]) == _META_END:
                (psize,) = _LMDB_PSIZE.unpack_from(pages[0], 40)
                if _page_size_ok(psize) and size >= psize + _META_END:
                    f.seek(psize)
                    pages.append(f.read(_META_END))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read {data.name}: {exc}"
    if size == 0:
        return f"{data.name} is empty"
    if len(pages[0]) < _META_END:
        return f"{data.name} is truncated to {size} bytes"
    (psize,) = _LMDB_PSIZE.unpack_from(pages[0], 40)
    if not _page_size_ok(psize):
        return f"{data.name} has no LMDB meta page (page size {psize})"
    if size < 2 * psize or len(pages) < 2 or len(pages[1]) < _META_END:
        return f"{data.name} is truncated to {size} bytes"
    for number, page in enumerate(pages):
        magic, version, _, _ = _LMDB_META.unpack_from(page, 16)
        if magic != _LMDB_MAGIC or version != 1:
            return f"{data.name} meta page {number} is damaged or foreign"
        last, _ = _LMDB_LAST.unpack_from(page, 136)
        if (last + 1) * psize > size:
            return (f"{data.name} is {size} bytes but its meta page {number} needs "
                    f"{(last + 1) * psize} (truncated or damaged)")
    return None


def _page_size_ok(psize: int) -> bool:
    return 512 <= psize <= 65536 and not psize & (psize - 1)

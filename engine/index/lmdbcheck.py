"""Checks of an LMDB data file made with plain reads, before LMDB maps it.

LMDB maps data.mdb and trusts the page numbers in it: a file shorter than its newest meta
page says (truncated, or a foreign file) makes the first access past the end kill the
process with SIGBUS. So the two meta pages are checked before LMDB ever sees the file
(docs/FORMAT.md "Index freshness"). It trusts its node pointers and sizes as much: one
flipped bit in a leaf's pointer array sent a read of the roots past the end of the file.
So the trees that every open reads (the main database and the small ones it names) are
walked with plain reads too, page by page. Offsets are those of LMDB 0.9 on 64-bit
platforms.
"""

from __future__ import annotations

import os
import pathlib
import struct

import lmdb

from ..errors import FormatError

_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_META = struct.Struct("<IIQQ")   # magic, version, address, mapsize at page offset 16
_LMDB_PSIZE = struct.Struct("<I")     # md_pad of the free-list db: the page size, offset 40
_LMDB_LAST = struct.Struct("<QQ")     # last page number, txn id, at page offset 136
_META_END = 152                       # bytes of a meta page this check reads


class DamagedIndex(FormatError):
    """data.mdb is truncated, not an LMDB file, or LMDB found its pages corrupted: the
    index must be rebuilt from the packs (a writable open does so by itself)."""


class UnsafeIndexFile(DamagedIndex):
    """Plain reads found data.mdb unsafe to map (``problem`` says why): LMDB never saw it."""

    def __init__(self, message: str, *, problem: str) -> None:
        super().__init__(message)
        self.problem = problem


class UnknownIndexVersion(FormatError):
    """The index claims a format version this code does not read: a newer cnrstore's
    index, or a damaged value. An open rebuilds it from the packs when every pack is of
    a version this code reads (freshness.open_index), else says to upgrade."""

    def __init__(self, message: str, *, version: int) -> None:
        super().__init__(message)
        self.version = version


# What LMDB reports for pages it cannot make sense of (as opposed to resource errors).
CORRUPTION = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError,
              lmdb.BadTxnError, lmdb.PanicError, lmdb.VersionMismatchError,
              lmdb.BadValsizeError, lmdb.IncompatibleError, lmdb.BadDbiError)


def data_file_problem(data: pathlib.Path, *, all_trees: bool = False) -> str | None:
    """Why ``data.mdb`` must not be handed to LMDB, or None (also for a missing file).
    ``all_trees`` walks ``objects`` too (verify, gc and repair read all of it; an open
    walks it only for an index of at most ``OPEN_WALK_ALL_BYTES``)."""
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
    return _trees_problem(data, psize, all_trees or size <= OPEN_WALK_ALL_BYTES)


# Page and node layout (mdb.c): page header, node header, the sub-database record.
_PAGE_HEAD = struct.Struct("<QHHHH")   # pgno, pad, flags, lower, upper
_NODE_HEAD = struct.Struct("<HHHH")    # lo, hi, flags, key size
_OVERFLOW_HEAD = struct.Struct("<QHHI")  # pgno, pad, flags, pages
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_FREE_DB, _MAIN_DB = 40, 88              # the two MDB_db records of a meta page
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_DB_RECORD = 48                        # sizeof(MDB_db)
_DB_ROOT = 40                          # md_root within it
_NO_PAGE = 0xFFFFFFFFFFFFFFFF          # P_INVALID: an empty database
_WALK_TRIES = 3


def _trees_problem(data: pathlib.Path, psize: int, all_trees: bool) -> str | None:
    """Walk the newest meta's main database and the small databases it names. A writer
    in another process may commit meanwhile; LMDB reuses a page only two commits after
    the last meta that reached it, so a walk that ends with the meta it began with saw one
    snapshot. One that did not is walked again, and after a few, trusted to LMDB."""
    try:
        with open(data, "rb") as f:
            fd = f.fileno()
            for _ in range(_WALK_TRIES):
                before = _newest_meta(fd, psize)
                problem = _walk_all(fd, psize, *before[1:], all_trees=all_trees)
                if problem is None or _newest_meta(fd, psize) == before:
                    return problem
    except FileNotFoundError:
        return None  # swapped out by a repair meanwhile: as a missing file above
    except OSError as exc:
        return f"cannot read {data.name}: {exc}"
    return None


def _newest_meta(fd: int, psize: int) -> tuple[int, int, int, int]:
    """(txn id, last page, main database root, free-list root) of the newer meta page."""
    metas = []
    for number in (0, 1):
        page = os.pread(fd, _META_END, number * psize)
        last, txn = _LMDB_LAST.unpack_from(page, 136)
        (main,) = _U64.unpack_from(page, _MAIN_DB + _DB_ROOT)
        (free,) = _U64.unpack_from(page, _FREE_DB + _DB_ROOT)
        metas.append((txn, last, main, free))
    return max(metas)


def _walk_all(fd: int, psize: int, last: int, main: int, free: int, *,
              all_trees: bool) -> str | None:
    seen: set[int] = set()
    named: list[tuple[bytes, int]] = []
    # The free list too: a write transaction takes pages from it, and a flipped page
    # number there made a gc write off the end of the file (SIGBUS).
    problem = (_walk(fd, psize, last, free, _FREE, seen, [])
               or _walk(fd, psize, last, main, b"(main)", seen, named))
    for name, root in named:
        if problem is None and (all_trees or name in SMALL_DATABASES):
            problem = _walk(fd, psize, last, root, name, seen, [])
    return problem


# Read at every open (FORMAT.md "Index"). ``objects`` grows with the store: an open walks
# it only while the file is small (a flipped branch pointer there killed a verify right
# after the open with SIGBUS, 1 in 4,000 random flips); verify, gc and repair, which read
# all of it anyway, walk it first whatever its size.
SMALL_DATABASES = frozenset({b"meta", b"roots", b"packs"})
OPEN_WALK_ALL_BYTES = 32 << 20
_FREE = b"(free list)"


def _walk(fd: int, psize: int, last: int, root: int, name: bytes, seen: set[int],
          named: list[tuple[bytes, int]]) -> str | None:
    if root == _NO_PAGE:
        return None
    todo = [root]
    while todo:
        pgno = todo.pop()
        where = f"database {name.decode(errors='replace')}, page {pgno}"
        if pgno < 2 or pgno > last or pgno in seen:
            return f"{where}: out of range or reached twice"
        seen.add(pgno)
        page = os.pread(fd, psize, pgno * psize)
        if len(page) < psize:
            return f"{where}: past the end of the file"
        head_pgno, _, flags, lower, upper = _PAGE_HEAD.unpack_from(page, 0)
        if head_pgno != pgno or flags & (_P_BRANCH | _P_LEAF) not in (_P_BRANCH, _P_LEAF):
            return f"{where}: not a tree page"
        if not _PAGE_HEAD.size <= lower <= upper <= psize or (lower - _PAGE_HEAD.size) % 2:
            return f"{where}: bad bounds {lower}..{upper}"
        for i in range((lower - _PAGE_HEAD.size) // 2):
            (off,) = _U16.unpack_from(page, _PAGE_HEAD.size + 2 * i)
            if not upper <= off <= psize - _NODE_HEAD.size:
                return f"{where}: node {i} at {off} is outside the page"
            lo, hi, nflags, ksize = _NODE_HEAD.unpack_from(page, off)
            body = off + _NODE_HEAD.size + ksize
            if flags & _P_BRANCH:
                if body > psize:
                    return f"{where}: node {i} runs past the page"
                todo.append(lo | hi << 16 | nflags << 32)
                continue
            size = lo | hi << 16
            if nflags & _F_BIGDATA:
                if body + 8 > psize:
                    return f"{where}: node {i} runs past the page"
                (first,) = _U64.unpack_from(page, body)
                problem = _overflow_problem(fd, psize, last, first, size)
                if problem is None and name == _FREE:
                    value = os.pread(fd, size, first * psize + _OVERFLOW_HEAD.size)
                    problem = _free_list_problem(value, last)
                if problem:
                    return f"{where}: node {i}: {problem}"
                continue
            if body + size > psize:
                return f"{where}: node {i} runs past the page"
            if name == _FREE:
                problem = _free_list_problem(page[body : body + size], last)
                if problem:
                    return f"{where}: node {i}: {problem}"
            if nflags & _F_SUBDATA and name == b"(main)" and size == _DB_RECORD:
                (sub,) = _U64.unpack_from(page, body + _DB_ROOT)
                named.append((bytes(page[off + _NODE_HEAD.size : body]), sub))
    return None


def _overflow_problem(fd: int, psize: int, last: int, first: int, size: int) -> str | None:
    if first < 2 or first > last:
        return f"overflow page {first} out of range"
    head = os.pread(fd, _OVERFLOW_HEAD.size, first * psize)
    head_pgno, _, flags, pages = _OVERFLOW_HEAD.unpack_from(head, 0)
    if head_pgno != first or not flags & _P_OVERFLOW or pages < 1:
        return f"page {first} is not an overflow page"
    if first + pages - 1 > last or size > pages * psize - _OVERFLOW_HEAD.size:
        return f"overflow run {first}+{pages} does not hold {size} bytes"
    return None


def _free_list_problem(value: bytes, last: int) -> str | None:
    """A free-list record: a count, then that many page numbers, descending (midl.h)."""
    if len(value) < 8 or len(value) % 8:
        return f"a free-list record of {len(value)} bytes"
    ids = struct.unpack(f"<{len(value) // 8}Q", value)
    if ids[0] != len(ids) - 1:
        return f"a free-list record counts {ids[0]} pages but holds {len(ids) - 1}"
    pages = ids[1:]
    if pages and (pages[-1] < 2 or pages[0] > last
                  or any(a <= b for a, b in zip(pages, pages[1:]))):
        return "a free-list record with pages out of range or order"
    return None


def _page_size_ok(psize: int) -> bool:
    return 512 <= psize <= 65536 and not psize & (psize - 1)

"""Restore: walk a step's manifest, decode the needed blocks in parallel, reassemble tables.

Each block is resolved (full block + its patches) and decoded independently, so blocks
decode on a thread pool (zstd in the engine, numpy copies and torch decoding release the
GIL). With ``rows=`` only the blocks overlapping the asked row range are read.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, wait
from typing import Any

import numpy as np
import torch

from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.codec.quantize import decode_rows
from cnrstore.core.blockread import Located, block_codes, codes_buffer
from cnrstore.core.prefault import Prefault
from cnrstore.core.readahead import Readahead, Started, table_blocks
from cnrstore.core.tablestate import parse_dtype
from cnrstore.core.windowread import Block, can_locate, read_windows, windows
from cnrstore.errors import CheckpointError, InvalidInput, InvalidType
from cnrstore.format.manifest import TableManifest
from engine import ObjectStore

__all__ = ["Pieces", "block_span", "check_slice", "new_output", "row_range", "read_table",
           "read_tables", "read_into", "read_many_into", "read_rows_into", "run_all",
           "table_hints"]


def row_range(sel: slice | None, rows: int) -> tuple[int, int, np.ndarray | None]:
    """Rows ``[lo, hi)`` covering ``sel``, plus the indices within that range to keep
    (None when the slice is contiguous)."""
    if sel is None:
        return 0, rows, None
    start, stop, step = check_slice(sel, rows)
    if step == 1:
        return start, max(start, stop), None
    idx = np.arange(start, stop, step, dtype=np.int64)
    if len(idx) == 0:
        return 0, 0, idx
    lo, hi = int(idx.min()), int(idx.max()) + 1
    return lo, hi, idx - lo


def check_slice(sel, rows: int, *, name: str = "") -> tuple[int, int, int]:
    """``sel.indices(rows)`` of a slice of ints with a non-zero step, else InvalidInput
    (``slice.indices`` raises ValueError or TypeError of its own)."""
    what = f"rows[{name!r}]" if name else "rows="
    if not isinstance(sel, slice):
        raise InvalidType(f"{what} must be a slice, got {type(sel).__name__}")
    parts = []
    for part in (sel.start, sel.stop, sel.step):
        if part is not None:
            try:  # ints and what stands for one (numpy ints); not floats, not bools
                if isinstance(part, bool):
                    raise TypeError
                part = operator.index(part)
            except TypeError:
                raise InvalidType(
                    f"{what}: slice bounds must be ints or None, got {sel!r}"
                ) from None
        parts.append(part)
    if parts[2] == 0:
        raise InvalidInput(f"{what}: slice step cannot be zero")
    return slice(*parts).indices(rows)


def run_all(pool: Executor, fn: Callable[[Any], None], items: Iterable[Any], *,
            lead: int = 0, then: Callable[[], None] | None = None) -> None:
    """``fn`` over ``items`` on ``pool``; raises the error of the lowest item that failed,
    as ``list(pool.map(...))`` would, once every started call has ended. The caller sleeps
    until then in one wait: ``map`` woke it at each block, and each wake took the GIL from
    the decode threads (a warm 1.075 GB restore: ~7% of its time). ``then()`` runs on the
    caller's thread once the first ``lead`` items have ended (failed or not), the pool
    going on with the rest; its error ranks after the lead items'."""
    futures = [pool.submit(fn, i) for i in items]
    late: BaseException | None = None
    if then is not None:
        wait(futures[:lead])
        try:
            then()
        except BaseException as exc:  # raised once the running calls have ended
            late = exc
            for f in futures[lead:]:
                f.cancel()
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    if pending:  # one failed: drop the blocks not begun, let the running ones end
        for f in pending:
            f.cancel()
        wait(futures)
    for k, f in enumerate(futures):
        if k == lead and late is not None:
            raise late
        if not f.cancelled():
            f.result()  # raises its error
    if late is not None:
        raise late


class Pieces:
    """Where the rows of one read go when no one tensor holds them: ``parts`` (lo, hi,
    contiguous CPU [hi - lo, width] rows of the stored dtype), disjoint, within the rows
    read. A block is read once and each piece decoded from its codes (a rank's rows and
    the rows it sends other ranks: distributed/boundary.py); rows no piece holds, nowhere."""

    def __init__(self, parts: list[tuple[int, int, torch.Tensor]], nbytes: int | None = None):
        self.parts = sorted(parts, key=lambda p: p[0])
        # what a read's ``done`` reports of these rows (a rank: its own, not those it sends)
        self.nbytes = sum(t.nbytes for _, _, t in parts) if nbytes is None else nbytes

    def within(self, start: int, stop: int) -> list[tuple[int, int, torch.Tensor]]:
        """(lo, hi, rows) of every piece's rows in ``[start, stop)``."""
        out = []
        for lo, hi, t in self.parts:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                out.append((a, b, t[a - lo:b - lo]))
        return out


def block_span(tm: TableManifest, rows: slice | None = None) -> tuple[int, int]:
    """Blocks ``[first, last)`` that ``read_table(tm, rows=rows)`` reads."""
    block_rows = tm.node.block_rows
    lo, hi, _ = row_range(rows, tm.node.rows)
    first = lo // block_rows
    return first, (-(-hi // block_rows) if hi > lo else first)


def new_output(tm: TableManifest, rows: slice | None = None) -> torch.Tensor:
    """Fresh memory for ``read_table(tm, rows=rows)`` to decode into: [rows, width]."""
    node = tm.node
    lo, hi, _ = row_range(rows, node.rows)
    try:
        return torch.empty((hi - lo, node.width), dtype=parse_dtype(node.dtype))
    except (RuntimeError, MemoryError) as exc:
        raise CheckpointError(f"table {node.name!r}: cannot allocate {hi - lo} rows of "
                              f"{node.width} {node.dtype} to restore into: {exc}") from None


def read_table(
    objects: ObjectStore,
    tm: TableManifest,
    pool: Executor,
    *,
    rows: slice | None = None,
    keep_codes: bool = False,
    fingerprints: bool = False,
    started: Started | None = None,
    into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, np.ndarray | None, torch.Tensor | None]:
    """Decode a stored table (or the rows ``rows`` of it) on the CPU, into ``into`` when
    given (``new_output``'s, its page faults the caller's business). With ``keep_codes`` also
    return the encoded rows of the range read (for seeding a lossy diff base); with
    ``fingerprints`` the row fingerprints of the decoded rows (for seeding an exact one),
    computed per block in the decode threads while the block is still in cache: a separate
    pass over a restored table cost as much again as decoding it."""
    out = new_output(tm, rows) if into is None else into
    blocks, one, finish = _table_read(objects, tm, rows, keep_codes, fingerprints, started, out)
    # out is fresh memory: its page faults were most of a restore
    faults = Prefault([out]) if into is None else None
    try:
        run_all(pool, one, blocks)
    finally:
        if faults is not None:
            faults.stop()
    return finish()


def _table_read(objects: ObjectStore, tm: TableManifest, rows: slice | None, keep_codes: bool,
                fingerprints: bool, started: Started | None, out: torch.Tensor | Pieces
                ) -> tuple[range, Callable[..., None], Callable[[], tuple]]:
    """(the blocks to decode, decode block i into ``out``, the result once all are) of
    ``read_table``. ``out`` may be ``Pieces`` (no codes or fingerprints kept then)."""
    node = tm.node
    dtype = parse_dtype(node.dtype)
    width = node.width
    lo, hi, pick = row_range(rows, node.rows)
    try:
        codes_out = np.empty((hi - lo, node.row_nbytes), dtype=np.uint8) if keep_codes else None
    except (RuntimeError, MemoryError) as exc:
        raise CheckpointError(
            f"table {node.name!r}: cannot allocate the codes of {hi - lo} rows: {exc}"
        ) from None
    fps = torch.empty(hi - lo, dtype=torch.int64) if fingerprints else None
    first, last = block_span(tm, rows)

    # Exact rows are their own codes: whole blocks decode straight into the returned table.
    direct = node.scheme == "exact" and width > 0

    pieces = out if isinstance(out, Pieces) else None
    rows_out = out if isinstance(out, torch.Tensor) else None
    if pieces is not None and (keep_codes or fingerprints or pick is not None):
        raise AssertionError("pieces of contiguous rows keep no codes nor fingerprints")

    def one(i: int, located: Located | None = None) -> None:
        hint(i - first)
        start, stop = node.block_range(i)
        a, b = max(start, lo), min(stop, hi)
        into = (pieces.within(a, b) if pieces is not None
                else [(a, b, rows_out[a - lo:b - lo])])  # type: ignore[index]
        if direct and len(into) == 1 and into[0][:2] == (start, stop):
            dest = into[0][2].view(torch.uint8).numpy()
            codes = block_codes(objects, tm, i, out=dest, located=located)
            part = codes
        else:
            codes = block_codes(objects, tm, i, out=codes_buffer(node, i), located=located)
            part = codes[a - start:b - start]
            for x, y, t in into:
                if width and y > x:  # zero-width rows decode to nothing (some codecs refuse)
                    decode_rows(torch.from_numpy(codes[x - start:y - start]), node.scheme,
                                dtype, width, out=t)
        if fps is not None and b > a:
            row_fingerprints(into[0][2], out=fps[a - lo:b - lo])
        if codes_out is not None:
            codes_out[a - lo:b - lo] = part

    def finish() -> tuple[Any, np.ndarray | None, torch.Tensor | None]:
        if rows_out is None:
            return pieces, None, None
        table = rows_out if pick is None else rows_out[torch.from_numpy(pick)]
        return table.reshape((table.shape[0], *node.shape[1:])), codes_out, fps

    hint = started or Readahead(objects, tm.block_ids[first:last],
                                node.block_rows * node.row_nbytes).started
    return range(first, last), one, finish


def _ticking(one: Callable[..., None], done: Callable[[int], None], nbytes: int,
             blocks: range) -> Callable[..., None]:
    """``one`` calling ``done`` with block i's share of ``nbytes`` after block i."""
    n, last = len(blocks), blocks[-1] if blocks else -1

    def ticked(i: int, located: Located | None = None) -> None:
        one(i, located)
        done(nbytes // n + (nbytes % n if i == last else 0))
    return ticked


def _no_hint(k: int) -> None:
    pass


def table_hints(objects: ObjectStore, wanted: list[tuple[TableManifest, slice | None]]
                ) -> list[Started]:
    """The ``started`` of each table of ``wanted``, over one read-ahead of all they read."""
    return table_blocks(objects, [
        (tm.block_ids[slice(*block_span(tm, rows))], tm.node.block_rows * tm.node.row_nbytes)
        for tm, rows in wanted])


def read_tables(objects: ObjectStore, pool: Executor,
                wanted: list[tuple[TableManifest, slice | None]], device: torch.device,
                done: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """``read_table`` of several tables (each with its ``rows``) as one restore, moved to
    ``device``: one read-ahead; for a CPU restore every output allocated first, one
    prefault thread over them in read order and one pass of the pool over all blocks (per
    table, each started over: docs/design/restore-path.md, "One read-ahead and one prefault"). For
    another device each table is decoded into host memory of its own and moved before
    the next: the host never holds more than one table."""
    if device.type != "cpu":
        started = table_hints(objects, wanted)
        out = []
        for (tm, rows), hint in zip(wanted, started):
            out.append(read_table(objects, tm, pool, rows=rows, started=hint)[0].to(device))
            if done is not None:
                done(out[-1].nbytes)
        return out
    fresh = [new_output(tm, rows) for tm, rows in wanted]
    faults = Prefault(fresh)
    try:
        return read_rows_into(objects, pool, [(tm, rows, dest) for (tm, rows), dest
                                              in zip(wanted, fresh)], done)
    finally:
        faults.stop()


def read_rows_into(objects: ObjectStore, pool: Executor,
                   wanted: Sequence[tuple[TableManifest, slice | None, torch.Tensor | Pieces]],
                   done: Callable[[int], None] | None = None, *, lead: int = 0,
                   then: Callable[[], None] | None = None) -> list[Any]:
    """``read_table(tm, rows=rows, into=into)`` of several (tm, rows, into) as one restore:
    one pass of the pool over all their blocks (a rank's pieces of a sharded load were
    read table by table, the pool drained at the end of each), in windows where the store
    locates records. Each ``into`` is a contiguous CPU [rows, width] tensor of the stored
    dtype, or ``Pieces`` of such. ``done``: called with the bytes of ``into`` decoded after
    each block. ``then``: called once the blocks of the first ``lead`` entries are decoded,
    while the pool decodes the others (``run_all``); those blocks are read first. A store
    that locates records is read in windows, each file forwards (windowread.py); one that
    cannot (a rank's located view) block by block behind one read-ahead of all."""
    windowed = can_locate(objects)
    started = ([_no_hint] * len(wanted) if windowed
               else table_hints(objects, [(tm, rows) for tm, rows, _ in wanted]))
    reads = [_table_read(objects, tm, rows, False, False, hint, dest)
             for (tm, rows, dest), hint in zip(wanted, started)]
    parts: list[list[Block]] = [[], []]   # the lead entries' blocks, then the others'
    for k, ((blocks_of, one, _), (tm, _, dest)) in enumerate(zip(reads, wanted)):
        if done is not None:  # ``done`` after each block: its share of the table's bytes
            one = _ticking(one, done, dest.nbytes, blocks_of)
        parts[k >= lead].extend((one, i, tm) for i in blocks_of)

    def window_done(window: list[Block]) -> None:
        if windowed:
            read_windows(objects, window)
        else:
            for one, i, _ in window:
                one(i, None)

    items = [windows(p) if windowed else [[b] for b in p] for p in parts]
    run_all(pool, window_done, items[0] + items[1], lead=len(items[0]), then=then)
    return [finish()[0] for _, _, finish in reads]


def read_into(
    objects: ObjectStore,
    tm: TableManifest,
    pool: Executor,
    dest: torch.Tensor,
    *,
    fingerprints: bool = False,
    keep_codes: bool = False,
    started: Started | None = None,
    done: Callable[[int], None] | None = None,
) -> tuple[np.ndarray | None, torch.Tensor | None]:
    """Decode a whole stored table into ``dest`` (its shape and dtype, any device), block by
    block: no table-sized buffer is allocated. A contiguous CPU ``dest`` of an exact table
    receives the decoded bytes directly; otherwise each block is decoded into a block-sized
    buffer and copied (to the device for CUDA). Returns (codes, fingerprints) like
    ``read_table`` for seeding a diff base; the codes are table-sized, so a caller asks for
    them only for lossy tables (they are smaller than the table)."""
    one, codes_out, fps = _into_read(objects, tm, dest, fingerprints, keep_codes, started,
                                     done)
    run_all(pool, one, range(tm.node.nblocks))
    return codes_out, fps


def read_many_into(objects: ObjectStore, pool: Executor,
                   wanted: list[tuple[TableManifest, torch.Tensor]],
                   done: Callable[[int], None] | None = None) -> None:
    """``read_into`` of several tables as one restore: one read-ahead and one pass of the
    pool over all their blocks, as ``read_tables`` (per table, the pool drained at the end
    of each: a training state is dozens of tables, moments and step counters beside each
    weight, and every drain left threads idle behind one table's last block)."""
    started = table_hints(objects, [(tm, None) for tm, _ in wanted])
    tasks: list[tuple[Callable[[int], None], int]] = []
    for (tm, dest), hint in zip(wanted, started):
        one = _into_read(objects, tm, dest, False, False, hint, done)[0]
        tasks.extend((one, i) for i in range(tm.node.nblocks))
    run_all(pool, lambda task: task[0](task[1]), tasks)


def _into_read(objects: ObjectStore, tm: TableManifest, dest: torch.Tensor,
               fingerprints: bool, keep_codes: bool, started: Started | None,
               done: Callable[[int], None] | None
               ) -> tuple[Callable[[int], None], np.ndarray | None, torch.Tensor | None]:
    """(decode block i into ``dest``, the codes, the fingerprints) of ``read_into``."""
    node = tm.node
    dtype = parse_dtype(node.dtype)
    width = node.width
    rows2d = dest.view(node.rows, width) if dest.is_contiguous() else None
    direct = (node.scheme == "exact" and width > 0 and rows2d is not None
              and dest.device.type == "cpu")
    codes_out = np.empty((node.rows, node.row_nbytes), dtype=np.uint8) if keep_codes else None
    fps = torch.empty(node.rows, dtype=torch.int64) if fingerprints else None
    row_bytes = dest.nbytes // node.rows if node.rows else 0

    def one(i: int) -> None:
        hint(i)
        start, stop = node.block_range(i)
        if direct and rows2d is not None:
            part = rows2d[start:stop]
            codes = block_codes(objects, tm, i, out=part.view(torch.uint8).numpy())
        else:
            codes = block_codes(objects, tm, i, out=codes_buffer(node, i))
            if rows2d is not None and rows2d.device.type == "cpu":
                part = rows2d[start:stop]  # decoded in place: no block-sized temporary
                if width and stop > start:
                    decode_rows(torch.from_numpy(codes), node.scheme, dtype, width, out=part)
            else:
                if width and stop > start:
                    part = decode_rows(torch.from_numpy(codes), node.scheme, dtype, width)
                else:
                    part = torch.empty((stop - start, width), dtype=dtype)
                if rows2d is not None:
                    rows2d[start:stop].copy_(part)
                else:
                    dest[start:stop].copy_(part.view((stop - start, *node.shape[1:])))
        if fps is not None and stop > start:
            row_fingerprints(part, out=fps[start:stop])
        if codes_out is not None:
            codes_out[start:stop] = codes
        if done is not None:  # ``done(bytes of dest decoded)`` after each block
            done((stop - start) * row_bytes)

    hint = started or Readahead(objects, tm.block_ids, node.block_rows * node.row_nbytes).started
    return one, codes_out, fps

"""Blocks that several ranks' rows share, read once (issue 26; docs/design/torchrec-speed.md,
"A block several ranks' rows share is read by one of them").

Where a restore's destination rows are cut between ranks off the block grid (TorchRec's
row-wise shards end mid-block), two or more ranks want rows of one block. The coordinator
decides which one reads it (core/get.py ``share``: the rank holding most of its rows);
the others do not read it, and that rank sends them their rows of it through the store's
group, point to point. A rank fills all its destination rows in one pass of its pool
(``fill_rows``): first the blocks it reads for others (its own rows of them into its
destination, the others' into send buffers, ``Pieces``), then it posts their sends
(gloo's own threads carry them) and decodes the rest of its blocks meanwhile; the rows
it receives land straight in its destination, posted before its first read.

No rank returns wrong rows and none waits forever: every rank posts every receive and
every send of the plan, whatever its read did (a rank whose read failed sends zeros of
the announced size, ``settle``), then enters the read's closing round with its error,
and every rank raises the lowest rank's there (core/get.py ``get``); a dead or hung peer
is ``RankFailed`` within the store's timeout. A moved pack makes every rank read again,
with a new plan (``transfer.again``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any

import torch
import torch.distributed as dist

from cnrstore.codec.layout import dtype_name
from cnrstore.core.get import MAX_SHARED, Located, out_bytes
from cnrstore.core.restore import (
    Pieces,
    read_into,
    read_rows_into,
    read_table,
    table_hints,
)
from cnrstore.core.tablestate import parse_dtype
from cnrstore.distributed.put import _Scratch
from cnrstore.distributed.shard import Shard
from cnrstore.errors import CheckpointError, RankFailed

__all__ = ["Exchange", "fill_rows", "in_place", "row_kind"]

# (table, range index) -> (manifest, first row, end row, the rows' [n, width] tensor)
Targets = dict[tuple[str, int], tuple[Any, int, int, torch.Tensor]]
# rows lo..hi of a table in a read, where they go, and whether they are this rank's own
Piece = tuple[int, int, torch.Tensor, bool]

_TAG_BITS = MAX_SHARED.bit_length() - 1  # a piece's tag: the read's round above, its index


def in_place(tm: Any, dest: Any) -> tuple[slice | None, torch.Tensor] | None:
    """(rows, into) when ``dest`` (a Shard, or a tensor of the whole table) decodes in
    place: contiguous CPU memory of the stored dtype, viewed as rows x width (what
    read_table and read_rows_into fill, with no second copy); else None. The request
    checked its rows and row shape against the stored table."""
    node = tm.node
    if isinstance(dest, Shard):
        t, rows, n = dest.local.detach(), slice(dest.row_offset, dest.row_end), \
            dest.row_end - dest.row_offset
    else:
        t, rows, n = dest.detach(), None, node.rows
    if (not t.is_contiguous() or t.device.type != "cpu" or dtype_name(t.dtype) != node.dtype
            or t.numel() != n * node.width):
        return None
    return rows, t.view(n, node.width)


def row_kind(pieces: Iterable[torch.Tensor]) -> str:
    """The request entry of a rank's destination row pieces of a table: "shared" where
    every piece is contiguous CPU memory (``in_place``: ``fill_rows`` fills them in its
    one pass, and a block they share with other ranks' may be read by one of them), else
    "shards" (each rank reads its own rows, one piece at a time)."""
    return "shared" if all(p.is_contiguous() and p.device.type == "cpu" for p in pieces) \
        else "shards"


def fill_rows(ds: Any, loc: Located, dests: list[tuple[str, int, Any]],
              done: Callable[[int], None] | None = None) -> None:
    """Fill every (table, k, dest) of ``dests``: ``dest`` a Shard, the destination of
    range k of the table's ranges in ``loc``, or a tensor of the whole table (k 0).
    Those that decode in place (``in_place``) in one pass of the pool, a block shared
    with other ranks read by one rank each (``loc.swap``, the module's docstring); then
    the others (a device's tensors, whose host copies must not all be held at once) one
    at a time: a Shard's rows into fresh memory and copied, a whole table block by block
    (``read_into``). ``done``: called with the bytes of the destinations filled, as they
    are (read_rows_into's ``done``, and those received once they are)."""
    swap: Exchange | None = loc.swap
    targets: Targets = {}
    later: list[tuple[Any, Any]] = []
    err: BaseException | None = None
    try:
        for n, k, dest in dests:
            tm, ranges = loc.tables[n]
            lo, hi = ranges[k]
            if isinstance(dest, Shard) and (lo, hi) != (dest.row_offset, dest.row_end):
                raise AssertionError(f"{n!r}: destination rows {dest.row_offset}.."
                                     f"{dest.row_end} filled as range {lo}..{hi} (a bug)")
            direct = in_place(tm, dest)
            if direct is None:
                later.append((tm, dest))
            elif hi > lo:
                targets[(n, k)] = (tm, lo, hi, direct[1])
        if swap is not None:
            swap.fill(loc, ds.pool, targets, done)
        elif targets:
            read_rows_into(loc.objects, ds.pool, _reads(targets, {}, {})[1], done)
    except BaseException as exc:
        err = exc
    if swap is not None:
        err = swap.settle(err)
        if err is None and done is not None and swap.received:
            done(swap.received)
    if err is not None:
        raise err
    if not later:
        return
    rows = [slice(d.row_offset, d.row_end) if isinstance(d, Shard) else None for _, d in later]
    hints = table_hints(loc.objects, [(tm, r) for (tm, _), r in zip(later, rows)])
    for (tm, dest), r, hint in zip(later, rows, hints):
        if r is None:
            read_into(loc.objects, tm, ds.pool, dest.detach(), started=hint)
        elif r.stop > r.start:
            got = read_table(loc.objects, tm, ds.pool, rows=r, started=hint)[0]
            with torch.no_grad():
                dest.local.copy_(got.view(dest.local.shape))
        if done is not None:
            done(out_bytes(tm, r))


class Exchange:
    """One rank's side of a read's shared blocks: ``plan`` is (receive, send) of
    core/get.py ``share``. ``fill`` posts the receives into the destination rows, reads
    this rank's blocks and sends; ``settle`` posts what was not (zeros), waits for all of
    it and returns the error the rank enters the closing round with. Send buffers come
    from the handle's host buffers and go back once sent."""

    def __init__(self, comm: Any, plan: tuple[list, list], buffers: Any):
        self.comm = comm
        self.receives, self.sends = plan
        self.scratch = _Scratch(buffers)
        # the same on every rank at this read (rounds are): no tag of an earlier read's;
        # below it the piece's index in the plan (fewer than get.MAX_SHARED)
        self.base = (comm.rounds % (1 << (30 - _TAG_BITS))) << _TAG_BITS
        self.works: list[Any] = []
        self.posted: set[tuple[str, int]] = set()   # ("r" or "s", tag)
        self.received = 0      # bytes received into destinations
        self.settled = False

    def _peer(self, r: int) -> int:
        return dist.get_global_rank(self.comm.pg, r)

    def _post(self, kind: str, tag: int, peer: int, data: torch.Tensor) -> None:
        self.posted.add((kind, tag))
        flat = data.view(torch.uint8).reshape(-1)
        if kind == "r":
            work = dist.irecv(flat, src=self._peer(peer), group=self.comm.pg,
                              tag=self.base + tag)
        else:
            work = dist.isend(flat, dst=self._peer(peer), group=self.comm.pg,
                              tag=self.base + tag)
        self.works.append(work)

    def fill(self, loc: Located, pool: Executor, targets: Targets,
             done: Callable[[int], None] | None) -> None:
        got: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for tag, src, n, k, lo, hi, nbytes in self.receives:
            if (n, k) in targets:
                tm, a, _, into = targets[(n, k)]
                self._post("r", tag, src, into[lo - a:hi - a])
                got.setdefault((n, k), []).append((lo, hi))
                self.received += nbytes
        sent: dict[str, list[Piece]] = {}
        out: list[tuple[int, int, torch.Tensor]] = []
        for tag, dst, n, lo, hi, nbytes in self.sends:
            node = loc.tables[n][0].node
            rows = self.scratch.take(nbytes)[:nbytes].view(parse_dtype(node.dtype))
            rows = rows.view(hi - lo, node.width)
            sent.setdefault(n, []).append((lo, hi, rows, False))
            out.append((tag, dst, rows))
        first, rest = _reads(targets, got, sent)

        def send() -> None:
            for tag, dst, rows in out:
                self._post("s", tag, dst, rows)

        if first or rest:
            read_rows_into(loc.objects, pool, first + rest, done, lead=len(first), then=send)
        else:  # every row of this rank's comes from others (it may have no source)
            send()

    def settle(self, err: BaseException | None) -> BaseException | None:
        """Post every receive and send of the plan not posted yet (into scratch, of
        zeros), wait for all and give the send buffers back; returns ``err``, or the
        error this rank raises if it had none: RankFailed for a peer that died or did
        not answer within the timeout, and an error for rows received nowhere."""
        if self.settled:
            return err
        self.settled = True
        lost = [m for m in self.receives if ("r", m[0]) not in self.posted]
        unsent = [m for m in self.sends if ("s", m[0]) not in self.posted]
        try:
            for tag, src, *_, nbytes in lost:
                self._post("r", tag, src, torch.empty(nbytes, dtype=torch.uint8))
            for tag, dst, *_, nbytes in unsent:
                self._post("s", tag, dst, torch.zeros(nbytes, dtype=torch.uint8))
            for w in self.works:
                w.wait()
        except (RuntimeError, dist.DistBackendError, ConnectionError) as exc:
            self.scratch.held = []  # gloo may still read them: never given back
            broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.comm.broken = self.comm.broken or broken
            failed = RankFailed(
                f"read: the rows of the blocks shared between ranks did not arrive: a rank "
                f"died or did not answer within {self.comm.timeout:g} s ({broken})")
            failed.__cause__ = exc
            return err or failed
        self.scratch.give()
        if err is None and (lost or unsent):  # zeros went out, or rows went nowhere
            return CheckpointError(f"read: {len(lost) + len(unsent)} row pieces of blocks "
                                   "shared between ranks were not read (a bug: report it)")
        return err


def _reads(targets: Targets, received: dict[tuple[str, int], list[tuple[int, int]]],
           sent: dict[str, list[Piece]]) -> tuple[list, list]:
    """This rank's read entries (manifest, rows, into) of ``targets`` less the rows it
    ``received``, with the rows it ``sent`` (per table, in send buffers): (those of the
    blocks it reads for others, the rest). No block is in two entries: pieces that share
    a block (a rank's own rows and those it sends, or two pieces of a rank's) are one
    entry's ``Pieces``, decoded from one read of it."""
    tms = {n: tm for (n, _), (tm, *_) in targets.items()}
    pieces: dict[str, list[Piece]] = {n: list(p) for n, p in sent.items()}
    for (n, k), (tm, a, b, into) in targets.items():
        R = tm.node.block_rows
        lead = {p[0] // R for p in sent.get(n, ())}
        for x, y in _without(a, b, received.get((n, k), [])):
            # cut at the blocks read for others: their rows are read first
            cuts = sorted({x, y} | {c for blk in lead for c in (blk * R, blk * R + R)
                                    if x < c < y})
            pieces.setdefault(n, []).extend((c, d, into[c - a:d - a], True)
                                            for c, d in zip(cuts, cuts[1:]))
    first: list[tuple[Any, slice, Any]] = []
    rest: list[tuple[Any, slice, Any]] = []
    for n, got in pieces.items():
        tm = tms.get(n)
        if tm is None:  # rows sent from a table this rank fills none of (not planned)
            raise AssertionError(f"{n!r}: rows to send from a table this rank does not read")
        R = tm.node.block_rows
        lead = {p[0] // R for p in got if not p[3]}
        groups: list[list[Piece]] = []
        for p in sorted(got, key=lambda p: p[0]):
            if groups and (groups[-1][-1][1] - 1) // R == p[0] // R:
                groups[-1].append(p)
            else:
                groups.append([p])
        for g in groups:
            span = slice(g[0][0], max(p[1] for p in g))
            dest: torch.Tensor | Pieces = g[0][2] if len(g) == 1 and g[0][3] else Pieces(
                [p[:3] for p in g], sum(p[2].nbytes for p in g if p[3]))
            (first if any(p[0] // R in lead for p in g) else rest).append((tm, span, dest))
    return first, rest


def _without(lo: int, hi: int, cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[lo, hi)`` less the disjoint ranges ``cut``, as ranges."""
    out, at = [], lo
    for a, b in sorted(cut):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if hi > at:
        out.append((at, hi))
    return out

"""Where the rows of a distributed put are: every rank's input as a spec, the global
tiling check, and which rank owns (plans and writes) each block of the global row grid.

A table is given on a rank as a plain tensor (the whole table: replicated when several
ranks give it, stored once), a ``Shard`` or a list of Shards. All ranks all-gather their
specs and run ``global_tables`` on the same list, so they reach the same verdict: the
same tables, or the same InvalidInput naming the rank and table, before anything is
written. Block ``b`` (rows ``[b*R, (b+1)*R)``) is owned by the rank holding its first row;
the rows of it that other ranks hold move to the owner (``sends``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.codec.layout import DTYPE_SIZES, dtype_name, parse_dtype
from cnrstore.core.validate import check_name, check_table
from cnrstore.distributed.shard import Shard
from cnrstore.errors import InvalidInput, InvalidType

__all__ = ["LocalTable", "GlobalTable", "local_tables", "global_tables", "Run", "runs",
           "sends", "moves", "moved_ids"]


@dataclass
class LocalTable:
    """One table as this rank gives it: ``pieces`` are (first global row, tensor)."""

    name: str
    plain: bool
    rows: int
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[int, torch.Tensor]]
    digest: str | None = None  # a plain table's content (``digest``), checked across ranks

    def spec(self) -> tuple:
        return (self.plain, self.rows, self.row_shape, dtype_name(self.dtype),
                [(lo, lo + int(t.shape[0])) for lo, t in self.pieces], self.digest)


@dataclass(frozen=True)
class GlobalTable:
    name: str
    rows: int
    row_shape: tuple[int, ...]
    dtype: str
    pieces: tuple[tuple[int, int, int], ...]   # (rank, lo, hi), ascending, non-empty, tiling

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.row_shape)

    def meta(self) -> torch.Tensor:
        """A data-less tensor of the table's shape and dtype (for quant resolution)."""
        return torch.empty(self.shape, dtype=self.torch_dtype, device="meta")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


def _check_tensor(name: str, value: torch.Tensor) -> None:
    check_table(name, value)  # the single-process rules, one implementation


def digest(t: torch.Tensor) -> str:
    """The content of a replicated table, compared across the ranks that give it: a hash
    of its row fingerprints (computed on the tensor's device, bit-exact on CPU and CUDA),
    so only 8 bytes a row leave the device."""
    fps = row_fingerprints(t.detach()).cpu().numpy()
    return hashlib.blake2b(fps.tobytes(), digest_size=16).hexdigest()


def local_tables(tables: Mapping, shard_leaf=None) -> dict[str, LocalTable]:
    """This rank's input, checked (the single-process rules, plus Shards)."""
    if not isinstance(tables, Mapping):
        raise InvalidType(f"tables must be a mapping name -> tensor, got {type(tables).__name__}")
    out: dict[str, LocalTable] = {}
    for name, value in tables.items():
        check_name("table name", name)
        try:
            shards = shard_leaf(value) if shard_leaf is not None else None
        except InvalidInput as exc:  # name the table (a column-sharded one, say)
            raise InvalidInput(f"table {name!r}: {exc}") from exc
        if shards is None and isinstance(value, Shard):
            shards = [value]
        elif shards is None and isinstance(value, (list, tuple)) and value and all(
                isinstance(v, Shard) for v in value):
            shards = list(value)
        if shards is None:
            if not isinstance(value, torch.Tensor):
                raise InvalidType(f"table {name!r} must be a torch.Tensor or cnrstore.Shard(s), "
                                  f"got {type(value).__name__}")
            _check_tensor(name, value)
            out[name] = LocalTable(name, True, int(value.shape[0]), tuple(value.shape[1:]),
                                   value.dtype, [(0, value.detach())], digest(value))
            continue
        pieces = []
        first = shards[0] if shards else None
        for s in shards:
            _check_tensor(name, s.local)
            if first is not None and (s.rows != first.rows or s.local.dtype != first.local.dtype
                                      or s.local.shape[1:] != first.local.shape[1:]):
                raise InvalidInput(f"table {name!r}: this rank's shards differ in rows, dtype "
                                   "or row shape")
            if s.local.shape[0]:
                pieces.append((s.row_offset, s.local.detach()))
        if first is None:
            raise InvalidInput(f"table {name!r}: an empty list of shards says nothing of the "
                               "table; leave the table out on this rank")
        out[name] = LocalTable(name, False, first.rows, tuple(first.local.shape[1:]),
                               first.local.dtype, pieces)
    return out


def global_tables(specs: list[dict[str, tuple]]) -> dict[str, GlobalTable]:
    """The tables of a put from every rank's specs (rank order), in first-seen order; the
    same InvalidInput on every rank for a gap, an overlap or a disagreement."""
    names: dict[str, list[tuple[int, tuple]]] = {}
    for rank, spec in enumerate(specs):
        for name, s in spec.items():
            names.setdefault(name, []).append((rank, s))
    plain_names = sorted(n for n, given in names.items() if given[0][1][0])
    out = {}
    for name, given in names.items():
        r0, (plain, rows, row_shape, dtype, _, content) = given[0]
        for r, s in given[1:]:
            if s[0] != plain:
                raise InvalidInput(f"table {name!r}: rank {r0} gives "
                                   f"{'a plain tensor' if plain else 'shards'}, rank {r} "
                                   f"{'a plain tensor' if s[0] else 'shards'}")
            if (s[2], s[3]) != (row_shape, dtype):
                raise InvalidInput(f"table {name!r}: rank {r} gives rows of shape {s[2]} "
                                   f"{s[3]}, rank {r0} of {row_shape} {dtype}")
            if s[1] != rows:
                raise InvalidInput(f"table {name!r}: rank {r} says it has {s[1]} rows, rank "
                                   f"{r0} says {rows}")
            if plain and s[5] != content:
                # Stored once, from one rank: a replica that differs would be lost silently.
                raise InvalidInput(
                    f"table {name!r}: rank {r} gives a plain tensor whose values differ "
                    f"from rank {r0}'s; a plain tensor is the whole table, replicated, and "
                    "every rank that gives it must give the same values (give each rank's "
                    "rows as cnrstore.Shard, or the table on one rank only)")
        if plain:  # replicated: stored once, by one of the ranks that give it
            ranks = [r for r, _ in given]
            owner = ranks[plain_names.index(name) % len(ranks)]
            pieces: tuple[tuple[int, int, int], ...] = ((owner, 0, rows),) if rows else ()
        else:
            found = sorted((lo, hi, r) for r, s in given for lo, hi in s[4])
            pos, last = 0, None
            for lo, hi, r in found:
                if lo > pos:
                    raise InvalidInput(f"table {name!r}: rows {pos}..{lo} are in no shard "
                                       f"(a gap before rank {r}'s rows {lo}..{hi})")
                if lo < pos:
                    raise InvalidInput(f"table {name!r}: rank {r}'s rows {lo}..{hi} overlap "
                                       f"rank {last}'s rows (up to {pos})")
                pos, last = hi, r
            if pos != rows:
                raise InvalidInput(f"table {name!r}: rows {pos}..{rows} are in no shard")
            pieces = tuple((r, lo, hi) for lo, hi, r in found)
        out[name] = GlobalTable(name, rows, tuple(row_shape), dtype, pieces)
    return out


@dataclass(frozen=True)
class Run:
    """Blocks ``[b0, b1)`` of a table that one rank owns: global rows ``[lo, hi)``."""

    name: str
    rank: int
    b0: int
    b1: int
    lo: int
    hi: int


def runs(table: GlobalTable, block_rows: int) -> list[Run]:
    """The block runs of ``table``, ascending; block b belongs to the rank holding row
    b*block_rows. A run's last block that holds another rank's rows too is a run of its
    own: the rest of the run is then a view of the owner's piece, and only that block is
    assembled (a copy) from its parts."""
    out: list[Run] = []
    for rank, lo, hi in table.pieces:
        b0, b1 = -(-lo // block_rows), -(-hi // block_rows)
        if b1 <= b0:
            continue
        if out and out[-1].rank == rank and out[-1].b1 == b0:
            b0 = out.pop().b0
        out.append(Run(table.name, rank, b0, b1, b0 * block_rows,
                       min(b1 * block_rows, table.rows)))
    split: list[Run] = []
    for run in out:
        cut = (run.b1 - 1) * block_rows
        if run.b1 - run.b0 > 1 and not any(
                r == run.rank and lo <= cut and run.hi <= hi for r, lo, hi in table.pieces):
            split += [Run(table.name, run.rank, run.b0, run.b1 - 1, run.lo, cut),
                      Run(table.name, run.rank, run.b1 - 1, run.b1, cut, run.hi)]
        else:
            split.append(run)
    return split


def sends(local: LocalTable, table: GlobalTable, block_rows: int, me: int
          ) -> tuple[list[tuple[int, int, torch.Tensor]], list[tuple[Run, list]]]:
    """(rows this rank sends: (dest rank, first row, tensor), and this rank's runs each
    with its local parts (first row, tensor)). Plain tables live on their owner only."""
    out: list[tuple[int, int, torch.Tensor]] = []
    mine: list[tuple[Run, list]] = []
    pieces = local.pieces
    if local.plain:
        pieces = pieces if any(r == me for r, _, _ in table.pieces) else []
    all_runs = runs(table, block_rows)
    for run in all_runs:
        parts = []
        for lo, t in pieces:
            a, z = max(lo, run.lo), min(lo + int(t.shape[0]), run.hi)
            if a >= z:
                continue
            if run.rank == me:
                parts.append((a, t[a - lo:z - lo]))
            else:  # a view: ``pack`` copies just these rows into the send buffer
                out.append((run.rank, a, t[a - lo:z - lo]))
        if run.rank == me:
            mine.append((run, parts))
    return out, mine


def moves(spec: tuple, table: GlobalTable, block_rows: int, me: int
          ) -> list[tuple[int, int, int]]:
    """The rows ``sends`` sends, from rank ``me``'s ``LocalTable.spec``: (dest rank, first
    row, rows), in the same order (every rank works them out for every rank)."""
    if spec[0]:
        return []  # a plain table lives on its owner, who owns all of its blocks
    out = []
    for run in runs(table, block_rows):
        if run.rank == me:
            continue
        for lo, hi in spec[4]:
            a, z = max(lo, run.lo), min(hi, run.hi)
            if a < z:
                out.append((run.rank, a, z - a))
    return out


def moved_ids(local: LocalTable, ids: torch.Tensor, block_rows: int) -> torch.Tensor:
    """The ``ids`` (global rows) that ``sends`` moves to another rank, known before the
    ranks' specs are: the rows of a piece's leading block whose first row no piece of
    this rank holds (shards do not overlap, so another rank holds it and owns the block;
    ``global_tables`` raises on every rank where they do overlap or leave a gap)."""
    held = [(lo, lo + int(t.shape[0])) for lo, t in local.pieces]
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    for lo, hi in held:
        first = lo // block_rows * block_rows
        if first < lo and not any(a <= first < b for a, b in held):
            keep |= (ids >= lo) & (ids < min(hi, first + block_rows))
    return ids[keep]


# Each message starts on this boundary in a send buffer, so that its bytes view as any
# table dtype (8 bytes at most, DTYPE_SIZES) without a copy.
_ALIGN = 8


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def message_nbytes(table: GlobalTable, nrows: int) -> int:
    """Bytes that ``nrows`` rows of ``table`` take in a send buffer (padded)."""
    return _padded(nrows * width(table.row_shape) * DTYPE_SIZES[table.dtype])


def pack(messages: list[list[torch.Tensor]], out: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, list[int]]:
    """One uint8 CPU buffer holding ``messages[r]`` (row tensors, in order) for each rank r,
    and the bytes for each rank: what ``Comm.exchange`` sends. The rows are copied once,
    from wherever they live (a GPU shard too), into ``out`` where given (a reused uint8
    buffer of at least that many bytes: fresh memory is first-touched in the stall)."""
    sizes = [sum(_padded(nbytes(t)) for t in ts) for ts in messages]
    buf = torch.empty(sum(sizes), dtype=torch.uint8) if out is None else out[:sum(sizes)]
    at = 0
    for ts in messages:
        for t in ts:
            n = nbytes(t)
            if n:
                src = t.detach().contiguous().reshape(-1).view(torch.uint8)
                buf[at:at + n].copy_(src)
            at += _padded(n)
    return buf, sizes


def unpack(buf: torch.Tensor, table: GlobalTable, nrows: int) -> tuple[torch.Tensor, int]:
    """The first message of ``buf`` as ``nrows`` rows of ``table`` (a view), and the
    bytes it took (``message_nbytes``)."""
    n = nrows * width(table.row_shape) * DTYPE_SIZES[table.dtype]
    rows = buf[:n].view(table.torch_dtype).view((nrows, *table.row_shape))
    return rows, _padded(n)


def assembles(run: Run, parts: list[tuple[int, torch.Tensor]]) -> bool:
    """Whether ``assemble`` copies: no one part holds all of ``run``'s rows."""
    n = run.hi - run.lo
    return not (len(parts) == 1 and parts[0][0] == run.lo and parts[0][1].shape[0] == n)


def assemble(run: Run, parts: list[tuple[int, torch.Tensor]], row_shape, dtype,
             take: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """The rows of ``run`` from its parts: a view when one part holds them all, else a
    copy, into ``take(nbytes)`` (a reused uint8 CPU buffer) where given and the parts are
    on the CPU."""
    n = run.hi - run.lo
    if not assembles(run, parts):
        return parts[0][1]
    device = parts[0][1].device if parts else torch.device("cpu")
    if take is not None and torch.device(device).type == "cpu":
        size = n * width(row_shape) * dtype.itemsize
        out = take(size)[:size].view(dtype).view((n, *row_shape))
    else:
        out = torch.empty((n, *row_shape), dtype=dtype, device=device)
    covered = 0
    for a, t in parts:
        out[a - run.lo:a - run.lo + t.shape[0]] = t.to(device)
        covered += int(t.shape[0])
    assert covered == n, (run, covered)
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size() if t.numel() else 0


def width(row_shape) -> int:
    return math.prod(row_shape)

"""The grouped layout's plan of a tracker-driven non-blocking put, made on the writer
thread (issue 27: the block policy, ~4 ms a 131072-row block, was most of a grouped put's
stall, 2.7-4.9x the chain layout's).

The caller's thread copies only what the step must hold: its touched rows, checked as a
non-blocking put checks what it copies, and every block whose stored list cannot be read
(written whole). The writer then fingerprints the copied rows, finds those that changed,
runs the block policy (grouppolicy.grouped_writes) and gathers the codes. A row the
cleaner writes again without it having changed is not in the copy: its codes are read
from the row object that holds its newest copy, which are the bytes the row's unchanged
values encode to (an encode is a function of the row's bytes), so the put writes the
objects, and the ids, a plan made in the stall writes (tests compare them).

Used by a single-process put only: a rank of a distributed put does not read the store
when it writes. A listed object that cannot be read when the writer needs its rows fails
the put (WriteFailed); the plan is then unmade, and the next put, untracked, diffs every
row against the base put back. A base whose objects a gc swept before the stall has lost
those slots there (TableState.revalidate): their blocks are copied and written whole."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cnrstore.codec.fingerprint import row_fingerprints
from cnrstore.codec.quantize import scheme_bits
from cnrstore.core.blockplan import TablePlan
from cnrstore.core.grouppolicy import ListedVersion, group_of, grouped_writes
from cnrstore.core.hostcodes import DEFER_DTYPES, HostBuffers, copy_checked, encode_checked
from cnrstore.core.tablestate import TableState, Undo
from cnrstore.errors import ManifestError, NonFiniteValues
from cnrstore.format.rowobjects import decode_rows_object

__all__ = ["GroupedDeferred"]


class GroupedDeferred:
    """Made by ``make`` in the stall; ``plan`` is the TablePlan the writer completes
    (``TablePlan.plan_later``), filling the state's slots and fingerprints, which a put
    diffing against it first waits for (``TableState.settle``)."""

    def __init__(self, name: str, x: torch.Tensor, table: torch.Tensor, cbase: TableState,
                 t: torch.Tensor, whole: dict[int, int], ids: np.ndarray,
                 copy_buf: torch.Tensor, copy: torch.Tensor, scheme: str, rnb: int,
                 wide: bool, step: int, buffers: HostBuffers, reader: Callable[[bytes], Any]):
        self.name, self.cbase, self.scheme, self.rnb, self.wide = name, cbase, scheme, rnb, wide
        self.t, self.tn, self.whole, self.step = t, t.numpy(), whole, step
        self.ids = ids  # the table row of each row of the copy
        self.copy_buf: torch.Tensor | None = copy_buf
        self.copy = copy
        self.codes_buf: torch.Tensor | None = None
        self.buffers, self.reader = buffers, reader
        rows = x.shape[0]
        nblocks = -(-rows // cbase.block_rows)
        self.state = TableState(
            shape=tuple(table.shape), dtype=table.dtype, scheme=scheme,
            block_rows=cbase.block_rows, fanout=cbase.fanout, row_nbytes=rnb,
            slots=[None] * nblocks, segments=list(cbase.segments), reader=cbase.reader,
            planning=threading.Event())
        self.state.undo = Undo(cbase, None)  # until planned: the base itself
        self.plan = TablePlan(name, self.state, [], np.zeros((0, rnb), dtype=np.uint8), 0,
                              table.numel() * table.element_size(), cbase.slots,
                              self.release)
        self.plan.step, self.plan.layout = step, "grouped"
        self.plan.plan_later = self.complete
        if cbase.damaged_blocks:
            self.plan.damaged_blocks = frozenset(i for i in cbase.damaged_blocks
                                                 if i < nblocks)

    @classmethod
    def make(cls, name: str, x: torch.Tensor, table: torch.Tensor, cbase: TableState,
             touched: torch.Tensor, scheme: str, rnb: int, wide: bool, step: int,
             buffers: HostBuffers, reader: Callable[[bytes], Any]) -> GroupedDeferred | None:
        """Copy the step's rows (in the stall); None where this put is planned now
        instead: a scheme that is neither exact nor intN, a dtype the copy does not
        check, or (intN, not wide) a copied row whose min/max needs wide qparams (the
        encode in the stall decides whether the table goes wide). Raises
        NonFiniteValues for a NaN or infinite touched row of an intN table, as the
        stall's encode does."""
        rows, width = x.shape
        quantized = scheme_bits(scheme) is not None
        if scheme != "exact" and not (quantized and x.dtype in DEFER_DTYPES):
            return None
        R = cbase.block_rows
        t = torch.unique(touched[touched < rows]).to("cpu")
        tn = t.numpy()
        nblocks = -(-rows // R)
        counts = np.bincount(tn // R, minlength=nblocks)
        whole: dict[int, int] = {}  # block -> its first row in the copy
        n = len(tn)
        for i in range(nblocks):
            nr = min((i + 1) * R, rows) - i * R
            old = cbase.slots[i] if i < len(cbase.slots) else None
            # as grouped_writes decides: a block with a slot is kept where no row of it
            # was touched, else planned on its list if that can be read; one without a
            # slot (a gc dropped its objects: TableState.revalidate) is written whole
            if old is not None and old.nrows == nr and (
                    not counts[i] or group_of(old, cbase, rnb)[0] is not None):
                continue
            whole[i] = n
            n += nr
        idx = np.concatenate([tn, *(np.arange(i * R, min((i + 1) * R, rows), dtype=np.int64)
                                    for i in whole)]) if whole else tn
        nbytes = n * width * x.element_size()
        buf = buffers.take(max(nbytes, 1), pinned=False)
        try:
            copy = buf[:nbytes].view(x.dtype).view(n, width)
            if quantized and n:
                finite, fits = copy_checked(x, idx, copy)
                if not finite.all():
                    raise NonFiniteValues(name, int(idx[int(np.argmin(finite))]), scheme)
                if not wide and not fits.all():
                    buffers.give(buf)
                    return None
            elif n:
                torch.index_select(x, 0, torch.from_numpy(idx), out=copy)
        except BaseException:
            buffers.give(buf)
            raise
        return cls(name, x, table, cbase, t, whole, idx, buf, copy, scheme, rnb, wide, step,
                   buffers, reader)

    def complete(self) -> None:
        """Plan from the copy (on the writer thread); a failure leaves the state with no
        diff data, which the next put writes full."""
        try:
            self._plan()
        except BaseException:
            self._unplanned()
            raise
        finally:
            assert self.state.planning is not None
            self.state.planning.set()

    def _plan(self) -> None:
        cbase, t, tn, copy = self.cbase, self.t, self.tn, self.copy
        assert cbase.fingerprints is not None
        R, rows = cbase.block_rows, self.state.rows
        nt = len(tn)
        fp = cbase.fingerprints.clone()
        now = row_fingerprints(copy[:nt]) if nt else fp[:0]
        differ = now != torch.index_select(fp, 0, t)
        fp.index_copy_(0, t[differ], now[differ])
        changed = tn[differ.numpy()]
        slots, writes, parts, pos, rewritten = grouped_writes(
            changed, cbase, rows, self.rnb, R, self.step)
        # the versions these were planned on (grouped_writes loads a list not loaded yet)
        olds: dict[int, ListedVersion] = {
            i: s.group for i, s in enumerate(cbase.slots)
            if s is not None and s.group is not None}
        self.codes_buf = buf = self.buffers.take(max(pos * self.rnb, 1), pinned=False)
        codes = buf[:pos * self.rnb].numpy().reshape(pos, self.rnb)
        at: list[np.ndarray] = []    # rows of the codes taken from the copy
        src: list[np.ndarray] = []   # and their rows in the copy
        for bw, part in zip(writes, parts):
            dst = np.arange(bw.start, bw.stop, dtype=np.int64)
            if bw.rows is None:  # written whole: copied in the stall
                first = self.whole.get(bw.index)
                if first is None:
                    raise AssertionError(f"put: table {self.name!r} block {bw.index} is "
                                         "written whole and was not copied (a bug: report it)")
                at.append(dst)
                src.append(np.arange(first, first + len(dst), dtype=np.int64))
                continue
            new = np.isin(part, changed, assume_unique=True)
            at.append(dst[new])
            src.append(np.searchsorted(tn, part[new]))  # changed rows are touched rows
            if not new.all():  # rows the cleaner writes again: from their last copy
                self._stored(codes, dst[~new], bw.rows[~new], olds[bw.index], bw.index)
        if at:
            dst_all, src_all = np.concatenate(at), np.concatenate(src)
            if len(dst_all):
                codes[dst_all] = self._encode(src_all)
        self.copy = copy[:0]
        if self.copy_buf is not None:  # read: back to the pool before the blocks are written
            self.buffers.give(self.copy_buf)
            self.copy_buf = None
        self.plan.writes, self.plan.codes, self.plan.rows_changed = writes, codes, len(changed)
        self.plan.rewritten_blocks = rewritten
        self.state.slots, self.state.fingerprints = slots, fp
        if self.state.outcome is None or self.state.outcome.failed is None:
            self.state.undo = Undo(cbase, changed)  # the rows this plan changed, not the base

    def _encode(self, src: np.ndarray) -> np.ndarray:
        """Codes of the copy's rows ``src``."""
        sel = torch.index_select(self.copy, 0, torch.from_numpy(src))
        if self.scheme == "exact":
            return sel.view(torch.uint8).numpy().reshape(len(src), self.rnb)
        return encode_checked(self.name, sel, self.scheme, self.wide, self.ids[src]).numpy()

    def _stored(self, codes: np.ndarray, dst: np.ndarray, rows: np.ndarray,
                old: ListedVersion, block: int) -> None:
        """codes[dst] = the stored codes of block rows ``rows`` (ascending), each from the
        object of ``old`` holding its newest copy."""
        owner = old.owner[rows]
        for j in np.unique(owner):
            piece = old.pieces[int(j)]
            if piece.oid is None:
                raise ManifestError(f"table {self.name!r} block {block}: a row object of the "
                                    "put before was not written")
            head, idx, _, got = decode_rows_object(self.reader(piece.oid), piece.oid,
                                                   rates=False)
            if got is None or head.row_nbytes != self.rnb:
                raise ManifestError("row object holds rows of another width", oid=piece.oid)
            mine = owner == j
            want = rows[mine]
            if idx is None:
                at = want - head.start
                ok = (at >= 0) & (at < head.count)
            else:
                at = np.searchsorted(idx, want)
                ok = at < len(idx)
                ok[ok] = idx[at[ok]] == want[ok]
            if not ok.all():
                raise ManifestError(f"row object does not hold row "
                                    f"{int(want[np.argmin(ok)])} of block {block}",
                                    oid=piece.oid)
            codes[dst[mine]] = got[at]

    def _unplanned(self) -> None:
        self.state.slots = [None] * len(self.state.slots)
        self.state.fingerprints = None

    def release(self) -> None:
        """Give the buffers back; a plan never made (its put failed before the writer
        ran it) leaves its state with no diff data, and no put waits for it."""
        assert self.state.planning is not None
        if not self.state.planning.is_set():
            self.plan.plan_later = None
            self._unplanned()
            self.state.planning.set()
        for buf in (self.copy_buf, self.codes_buf):
            if buf is not None:
                self.buffers.give(buf)
        self.copy_buf = self.codes_buf = None

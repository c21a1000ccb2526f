"""The plan of a tracker-driven non-blocking put of one table, made on the writer thread
(issue 26: a rank planned the 24-42 k rows its tracker saw in its stall; issue 27: the
grouped layout's block policy took ~4 ms a 131072-row block there, and the chain layout's
diff and policy most of its stall).

The caller's thread copies only what the step must hold: its touched rows (an intN
table's checked as a non-blocking put checks what it copies) and every block the policy
may write whole with rows it does not know: a block with no slot, a chain block that
cannot take a patch of all its touched rows (``chainpolicy.patch_fits``: the patch's
bytes grow with its rows, so a block that fits with every touched row changed fits with
any subset, and a patch holds only changed rows, all of them touched) and may be merged
or rewritten, a grouped block whose list cannot be read. The writer then fingerprints the
copied rows, finds those that changed, runs the layout's block policy
(blockplan.block_writes, grouppolicy.grouped_writes) and gathers the codes: the plan made
at once, so the same bytes and ids (tests compare them with blocking puts).

A grouped block's cleaner writes again rows that did not change and that no copy holds
(any row of the block may be among them): their codes are read from the row object that
holds each one's newest copy. Those are the bytes the row's unchanged values encode to
(an encode is a function of the row's bytes). This needs the store on the writer thread,
so a rank of a distributed put, whose writer does not read the store, plans grouped blocks
in its stall. A listed object that cannot be read when the writer needs its rows fails the
put (WriteFailed); the plan is then unmade, and the next put, untracked, diffs every row
against the base put back. A base whose objects a gc swept before the stall has lost those
slots there (TableState.revalidate): their blocks are copied and written whole.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cnrstore.codec.fpdiff import gathered_changes
from cnrstore.codec.quantize import scheme_bits
from cnrstore.core.blockplan import TablePlan, block_writes
from cnrstore.core.chainpolicy import block_key, patch_fits
from cnrstore.core.grouppolicy import ListedVersion, group_of, grouped_writes
from cnrstore.core.hostcodes import DEFER_DTYPES, HostBuffers, copy_refusing, encode_checked
from cnrstore.core.tablestate import TableState, Undo
from cnrstore.errors import ManifestError
from cnrstore.format.rowobjects import decode_rows_object

__all__ = ["Policy", "WriterPlan"]


@dataclass(frozen=True)
class Policy:
    """The block policy a table's put runs: ``layout`` ("chains" or "grouped"), and the
    chain layout's bound and its table's first block (a rank's part)."""

    layout: str
    max_chain: int
    block_offset: int


class WriterPlan:
    """Made by ``make`` in the stall; ``plan`` is the TablePlan the writer completes
    (``TablePlan.plan_later``), filling the state's slots and fingerprints, which a put
    diffing against it first waits for (``TableState.settle``)."""

    def __init__(self, name: str, x: torch.Tensor, table: torch.Tensor, cbase: TableState,
                 policy: Policy, t: torch.Tensor, whole: dict[int, int], ids: np.ndarray,
                 copy_buf: torch.Tensor, copy: torch.Tensor, scheme: str, rnb: int,
                 wide: bool, step: int, buffers: HostBuffers, objects: Any):
        self.name, self.cbase, self.scheme, self.rnb, self.wide = name, cbase, scheme, rnb, wide
        self.policy, self.dtype = policy, x.dtype
        self.t, self.tn, self.whole, self.step = t, t.numpy(), whole, step
        self.ids = ids  # the table row of each row of the copy
        self.copy_buf: torch.Tensor | None = copy_buf
        self.copy = copy
        self.codes_buf: torch.Tensor | None = None
        self.buffers, self.objects = buffers, objects
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
        self.plan.step, self.plan.layout = step, policy.layout
        self.plan.plan_later = self.complete
        if cbase.damaged_blocks:
            self.plan.damaged_blocks = frozenset(i for i in cbase.damaged_blocks
                                                 if i < nblocks)

    @classmethod
    def make(cls, name: str, x: torch.Tensor, table: torch.Tensor, cbase: TableState,
             policy: Policy, touched: torch.Tensor, scheme: str, rnb: int, wide: bool,
             step: int, buffers: HostBuffers, objects: Any) -> WriterPlan | None:
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
            if old is not None and old.nrows == nr and (not counts[i] or (
                    group_of(old, cbase, rnb)[0] is not None if policy.layout == "grouped"
                    else patch_fits(old, block_key(name, policy.block_offset + i),
                                    int(counts[i]), rnb, policy.max_chain))):
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
                if not copy_refusing(name, x, idx, copy, scheme, wide):
                    buffers.give(buf)
                    return None
            elif n:
                torch.index_select(x, 0, torch.from_numpy(idx), out=copy)
        except BaseException:
            buffers.give(buf)
            raise
        return cls(name, x, table, cbase, policy, t, whole, idx, buf, copy, scheme, rnb, wide,
                   step, buffers, objects)

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
        cbase, t, tn, copy, policy = self.cbase, self.t, self.tn, self.copy, self.policy
        assert cbase.fingerprints is not None
        R, rows = cbase.block_rows, self.state.rows
        fp = cbase.fingerprints.clone()
        changed = gathered_changes(copy[:len(tn)], t, fp)
        rewritten = 0
        if policy.layout == "grouped":
            slots, writes, parts, pos, rewritten = grouped_writes(
                changed, cbase, rows, self.rnb, R, self.step)
        else:
            slots, writes, parts, pos = block_writes(
                self.name, fp, changed, cbase, rows, self.dtype, self.state.width,
                self.scheme, self.rnb, R, policy.max_chain, policy.block_offset)
        self.codes_buf = buf = self.buffers.take(max(pos * self.rnb, 1), pinned=False)
        codes = buf[:pos * self.rnb].numpy().reshape(pos, self.rnb)
        at: list[np.ndarray] = []    # rows of the codes taken from the copy
        src: list[np.ndarray] = []   # and their rows in the copy
        for bw, part in zip(writes, parts):
            dst = np.arange(bw.start, bw.stop, dtype=np.int64)
            start = bw.index * R
            local: np.ndarray = (np.arange(part[1] - part[0], dtype=np.int64)
                                 if isinstance(part, tuple) else part - start)
            first = self.whole.get(bw.index)
            if first is not None:  # copied whole in the stall
                at.append(dst)
                src.append(local + first)
                continue
            new = np.isin(local + start, changed, assume_unique=True)
            at.append(dst[new])
            src.append(np.searchsorted(tn, local[new] + start))  # changed rows: touched
            if new.all():
                continue
            # the version this was planned on (grouped_writes loads a list not loaded yet)
            old = cbase.slots[bw.index] if bw.index < len(cbase.slots) else None
            if policy.layout != "grouped" or old is None or old.group is None:
                raise AssertionError(f"put: table {self.name!r} block {bw.index} writes rows "
                                     "that were not copied (a bug: report it)")
            self._stored_rows(codes, dst[~new], local[~new], old.group, bw.index)
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

    def _stored_rows(self, codes: np.ndarray, dst: np.ndarray, rows: np.ndarray,
                     old: ListedVersion, block: int) -> None:
        """codes[dst] = the stored codes of block rows ``rows`` (ascending), each from the
        object of grouped version ``old`` holding its newest copy."""
        owner = old.owner[rows]
        for j in np.unique(owner):
            piece = old.pieces[int(j)]
            if piece.oid is None:
                raise ManifestError(f"table {self.name!r} block {block}: a row object of the "
                                    "put before was not written")
            head, idx, _, got = decode_rows_object(self.objects.get(piece.oid), piece.oid,
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

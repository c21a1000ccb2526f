"""Reading many located records at once (``ObjectStore.get_many_at`` of a pack store).

A grouped-layout block version is ~175 row objects of a few KB each, written by ~150
steps: one pread, one header parse and one check per object made the engine's record
read most of its restore (docs/design/grouped-layout.md, "Reads"). The objects one step
wrote to a window of consecutive blocks lie side by side in that step's pack, so here
the records are sorted by (pack, offset) and those at most ``GAP`` apart are read with
one pread of at most ``SPAN`` bytes. Each record is then cut out of that read and
checked exactly as a single read checks it (``core.checked_record``: checksum, bounded
decompression, id, kind); a read of a span that fails in any way (its pack gone after a
gc, truncated, an offset no file has) falls back to reading each of its records alone,
which looks a moved record up again and raises what a single read raises.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import zstandard

from ..api import Object
from ..format.location import RecordLocation
from ..packs.pack import PackReaders
from .core import checked_record

__all__ = ["GAP", "SPAN", "coalesce", "read_many_at"]

# Bytes of other records a span may read over between two wanted ones: below a pread's
# cost warm and far below a seek's cold, and the other blocks' objects of a step are
# rarely further apart in its pack.
GAP = 64 << 10
# The most bytes one span reads: a run past it starts a new span, so the read buffer
# (the records are copied out of it) stays small beside a restore's window.
SPAN = 8 << 20


def coalesce(locs: Sequence[RecordLocation], gap: int = GAP, span: int = SPAN
             ) -> list[tuple[int, int, int, list[int]]]:
    """(pack, start, end, positions in ``locs``) of the spans that read ``locs``, each
    span's records ascending by offset. A location with a negative offset or no length
    is a span of its own (its single read reports it)."""
    order = sorted(range(len(locs)), key=lambda i: (locs[i].pack, locs[i].offset))
    out: list[tuple[int, int, int, list[int]]] = []
    for i in order:
        loc = locs[i]
        end = loc.offset + loc.length
        if out and loc.offset >= 0 and loc.length > 0:
            pack, start, last, at = out[-1]
            if (pack == loc.pack and start >= 0 and last > start
                    and loc.offset - last <= gap and max(last, end) - start <= span):
                out[-1] = (pack, start, max(last, end), at + [i])
                continue
        out.append((loc.pack, loc.offset, end, [i]))
    return out


def read_many_at(readers: PackReaders, locs: Sequence[RecordLocation],
                 dctx: zstandard.ZstdDecompressor, single: Callable[[RecordLocation], Object],
                 *, gap: int = GAP, span: int = SPAN, hint: bool = False,
                 views: bool = False) -> list[Object]:
    """The checked objects at ``locs``, in their order; ``single`` reads one location
    alone (the store's ``get_at``), for spans of one record and failed span reads.
    ``hint`` (a grouped restore's window: its records lie in ~150 packs): every span, a
    record alone too, read by ``PackReaders.read_spans``, each pack opened once and all
    spans hinted to the kernel first, so a cold disk reads them together. (Without it a
    chain window's patches read as before: read_spans there took a cold chain restore
    5-10% longer, unexplained.) ``views``: a raw record's payload is a read-only view of
    its span's read (which it keeps alive), not a copy."""
    got: list[Object | None] = [None] * len(locs)
    spans = coalesce(locs, gap, span)
    datas: dict[int, bytes | Exception] = {}
    if hint:  # every span of every pack, a record alone too, hinted and then read
        ok = [i for i, (_, start, end, _) in enumerate(spans) if start >= 0 and end > start]
        datas = dict(zip(ok, readers.read_spans(
            [(spans[i][0], spans[i][1], spans[i][2] - spans[i][1]) for i in ok],
            advise=True)))
    for k, (pack, start, end, at) in enumerate(spans):
        data = datas.get(k)
        if data is None and not hint and len(at) > 1:
            try:
                data = readers.read(pack, start, end - start)
            except Exception as exc:  # noqa: BLE001 - every failure is the single reads'
                data = exc
        if not isinstance(data, bytes):  # a failure, or a record alone: the single reads
            for i in at:
                got[i] = single(locs[i])
            continue
        view = memoryview(data)
        for i in at:
            loc = locs[i]
            a = loc.offset - start
            got[i] = checked_record(view[a:a + loc.length], loc.oid, pack, loc.offset,
                                    loc.kind, dctx, raw_len=loc.raw_len, as_view=views)
    assert all(o is not None for o in got)
    return got  # type: ignore[return-value]  # every position was filled above

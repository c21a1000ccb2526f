"""Scanning pack files without the index: headers, trailers, every record (repair and
gc's leftovers). Moved out of engine/packs/pack.py (module size); ``pack`` re-exports it."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import zstandard

from ..errors import CorruptObject
from ..format import records as fmt
from ..format import trailer
from ..format.trailer import read_trailer  # noqa: F401 - re-exported with the scans


def read_pack_header(path: pathlib.Path, *, name: str) -> fmt.PackHeader:
    with open(path, "rb") as f:
        return fmt.PackHeader.unpack(f.read(fmt.PACK_HEADER.size), pack=name)


@dataclass(frozen=True)
class ScannedRecord:
    offset: int
    record: fmt.Record | None  # None when damaged; an object's payload is not kept (b"")
    error: CorruptObject | None


def scan_records(data: bytes, *, name: str, entries: list[trailer.TrailerEntry] | None
                 ) -> Iterator[ScannedRecord]:
    """Decode every record of a pack image, by trailer entries or, without a usable
    trailer, sequentially from the header, resyncing on the next record magic after damage."""
    dctx = zstandard.ZstdDecompressor()
    if entries is not None:
        for e in entries:
            yield _decode_at(data, e.offset, name, dctx)
        return
    offset = fmt.PACK_HEADER.size
    while offset + fmt.RECORD_HEADER.size <= len(data):
        scanned = _decode_at(data, offset, name, dctx)
        if scanned.record is not None:
            yield scanned
            offset += scanned.record.header.length
            continue
        if data[offset : offset + 4] == fmt.RECORD_MAGIC:
            yield scanned  # a damaged record, not the trailer or padding
        nxt = data.find(fmt.RECORD_MAGIC, offset + 1)
        if nxt < 0:
            return
        offset = nxt


def _decode_at(data: bytes, offset: int, name: str,
               dctx: zstandard.ZstdDecompressor | None) -> ScannedRecord:
    # An object's payload is checked as it streams and not kept: repair indexes records
    # by header and refs, and a crafted record of a few KB may expand to gigabytes.
    try:
        return ScannedRecord(offset, fmt.check_payload(data, offset, pack=name, dctx=dctx),
                             None)
    except CorruptObject as exc:
        return ScannedRecord(offset, None, exc)

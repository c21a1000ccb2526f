"""Atheris target: the pack trailer (footer + entry table) and pack header decoders.

The input plays the tail of a pack file: the footer is its last bytes, the entries sit
where the footer says. Any input must decode or raise ``CorruptObject``, nothing else.
``check(data)`` is the target body; see fuzz/README.md for the long run.
"""

from __future__ import annotations

import contextlib
import sys

import xxhash

# Under atheris (run as a script) only engine/ is instrumented: instrumenting every
# loaded module costs a minute of start-up and adds coverage noise.
if __name__ == "__main__":
    import atheris

    _instrumented = atheris.instrument_imports(include=["engine"])
else:
    _instrumented = contextlib.nullcontext()

with _instrumented:
    from engine.errors import CorruptObject
    from engine.format.records import (
        CHECKSUM,
        FORMAT_VERSION,
        PACK_HEADER,
        RECORD_OBJECT,
        RECORD_ROOTS,
        PackHeader,
    )
    from engine.format.trailer import (
        FOOTER,
        TRAILER_ENTRY,
        TrailerEntry,
        decode_trailer,
        encode_trailer,
        parse_footer,
    )


def reseal(data: bytes) -> bytes:
    """Rewrite the trailer checksum the footer's own fields call for, so mutations of the
    entries reach the range checks behind the checksum."""
    size = len(data)
    if size < FOOTER.size + CHECKSUM.size:
        return data
    _, _, count, entries_offset, _ = FOOTER.unpack_from(data, size - FOOTER.size)
    start = entries_offset if 0 <= entries_offset < size - CHECKSUM.size else 0
    body = data[start : size - CHECKSUM.size]
    return data[: size - CHECKSUM.size] + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def check(data: bytes) -> None:
    if data[:1] == b"\x01":
        data = reseal(data[1:])
    try:
        PackHeader.unpack(data[: PACK_HEADER.size], pack="fuzz")
    except CorruptObject:
        pass
    size = len(data)
    try:
        count, entries_offset = parse_footer(bytes(data[-FOOTER.size :]), size, pack="fuzz")
    except CorruptObject:
        return
    assert entries_offset + count * TRAILER_ENTRY.size + FOOTER.size == size
    try:
        entries = decode_trailer(bytes(data[entries_offset:]), count, entries_offset, pack="fuzz")
    except CorruptObject:
        return
    assert len(entries) == count
    for e in entries:
        assert PACK_HEADER.size <= e.offset and e.offset + e.length <= entries_offset


def seeds() -> list[bytes]:
    """Pack tails with valid trailers of 0, 1 and 3 entries (records as filler bytes)."""
    out = []
    for n in (0, 1, 3):
        head = PackHeader(FORMAT_VERSION, n == 1, n).pack()
        body = bytes(100 * n)
        entries = [
            TrailerEntry(len(head) + 100 * k, 100, RECORD_ROOTS if k == 2 else RECORD_OBJECT,
                         bytes([k]) * 16)
            for k in range(n)
        ]
        out.append(head + body + encode_trailer(entries, len(head) + len(body)))
    return out + [b"\x01" + tail for tail in out]


def main() -> None:
    import atheris
    from _corpus import with_corpus

    atheris.Setup(with_corpus(sys.argv, "trailer", seeds()), check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

"""Atheris target: the pack record decoder (and the roots snapshot inside ROOTS records).

Any input must decode cleanly or raise ``CorruptObject``; any other exception, a hang or
a big allocation is a bug. ``check(data)`` is the target body; the test suite calls it
directly on Hypothesis inputs, and ``python fuzz/fuzz_record.py [libFuzzer flags]`` runs
it under coverage-guided atheris (see fuzz/README.md).
"""

from __future__ import annotations

import contextlib
import sys

import xxhash
import zstandard

# Under atheris (run as a script) only engine/ is instrumented: instrumenting every
# loaded module costs a minute of start-up and adds coverage noise.
if __name__ == "__main__":
    import atheris

    _instrumented = atheris.instrument_imports(include=["engine"])
else:
    _instrumented = contextlib.nullcontext()

with _instrumented:
    from engine.errors import CorruptObject
    from engine.format.ids import object_id
    from engine.format.records import (
        CHECKSUM,
        RECORD_HEADER,
        RECORD_OBJECT,
        RECORD_ROOTS,
        check_record,
        decode_record,
        decode_snapshot,
        encode_record,
        encode_snapshot,
        snapshot_id,
    )


def reseal(body: bytes) -> bytes:
    """Append the checksum a record ending here would carry, so that mutations reach the
    decoding past the checksum (lengths, codec, zstd, ids) instead of dying at it."""
    return body + CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def check(data: bytes) -> None:
    if data[:1] == b"\x01":
        data = reseal(data[1:])
    # Records sit after the pack header in real packs; a leading pad of 0x00 bytes moves
    # the record off offset 0 so offset arithmetic is covered too.
    offset = len(data) - len(data.lstrip(b"\x00")) if data[:1] == b"\x00" else 0
    try:
        rec = decode_record(data, offset, pack="fuzz")
    except CorruptObject:
        rec = None
    if rec is not None:
        head = rec.header
        assert offset + head.length <= len(data), "decoded past the buffer"
        assert len(rec.payload) == head.raw_len, "payload length differs from header"
        assert len(rec.refs) == head.nrefs
        # A record that decodes must pass the cheap scan used by gc and repair as well.
        assert check_record(data, offset, pack="fuzz") == head
        if head.rtype == RECORD_ROOTS:
            try:
                decode_snapshot(rec.payload, pack="fuzz", offset=offset)
            except CorruptObject:
                pass
    # The snapshot decoder on raw junk, past the record header.
    try:
        decode_snapshot(bytes(data[RECORD_HEADER.size :]), pack="fuzz", offset=0)
    except CorruptObject:
        pass


def seeds() -> list[bytes]:
    """Valid records of every shape (raw, zstd, refs, roots snapshot): the starting corpus,
    since random bytes rarely get past the magic."""
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=True)
    out = []
    ref = object_id(1, (), b"leaf")
    for kind, refs, payload in [
        (1, (), b""),
        (1, (), b"leaf"),
        (2, (ref,), b"node" * 40),  # compressible: zstd codec
        (3, (ref, ref), bytes(range(256))),
    ]:
        oid = object_id(kind, refs, payload)
        for ctx in (None, cctx):
            out.append(encode_record(RECORD_OBJECT, kind, refs, payload, oid, cctx=ctx))
    snap = encode_snapshot(3, {"step/1": ref, "latest": ref})
    out.append(encode_record(RECORD_ROOTS, 0, (), snap, snapshot_id(snap), cctx=None))
    return out + [b"\x01" + rec[: -CHECKSUM.size] for rec in out]


def main() -> None:
    import atheris
    from _corpus import with_corpus

    atheris.Setup(with_corpus(sys.argv, "record", seeds()), check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

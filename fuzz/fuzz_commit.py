"""Atheris target: the commit-document decoder of bucket and shared-directory stores
(``engine.format.commitdoc.decode_commit``).

Any input must decode to a document that passed every field check, or raise
``CorruptObject``, nothing else. An input whose first byte is 0x01 is *resealed*: the
rest becomes the body of a version-2 document with a valid checksum, so mutations reach
the msgpack decoder and the field checks behind it. ``check(data)`` is the target body;
see fuzz/README.md for the long run.
"""

from __future__ import annotations

import contextlib
import sys

import msgpack
import xxhash

if __name__ == "__main__":
    import atheris

    _instrumented = atheris.instrument_imports(include=["engine"])
else:
    _instrumented = contextlib.nullcontext()

with _instrumented:
    from engine.errors import CorruptObject
    from engine.format.commitdoc import (
        HEADER,
        MAGIC,
        MAX_PACK,
        VERSION,
        CommitDoc,
        commit_key,
        decode_commit,
        encode_commit,
    )

KEY = commit_key(3)


def reseal(body: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, xxhash.xxh3_64_intdigest(body)) + body


def check(data: bytes) -> None:
    if data[:1] == b"\x01":
        data = reseal(data[1:])
    try:
        doc = decode_commit(data, KEY)
    except CorruptObject:
        return
    # What the cache applies must be what the checks promise.
    assert doc.seq == 3 and doc.kind in ("put", "gc")
    for n, _, meta, entries in doc.packs:
        assert 0 <= n <= MAX_PACK and isinstance(meta, bool)
        for oid, *_, refs in entries:
            assert len(oid) == 16 and all(len(r) == 16 for r in refs)
    assert all(isinstance(k, str) and len(v) == 16 for k, v in doc.sets.items())
    assert all(isinstance(k, str) for k in (*doc.deletes, *doc.creates))
    assert decode_commit(encode_commit(doc), KEY) == doc  # the type says all the body did


def seeds() -> list[bytes]:
    """A writer's put, a gc, and an old version-1 document; each also resealable."""
    oid, ref = b"\x11" * 16, b"\x22" * 16
    put = {"seq": 3, "kind": "put", "time": 1.7e9, "token": b"\x33" * 16,
           "packs": [[7, 4096, False, [[oid, 16, 100, 1, 120, []]]],
                     [8, 512, True, [[ref, 16, 50, 2, 50, [oid]]]]],
           "set": {"step/1": ref}, "del": ["step/0"], "creates": ["step/1"]}
    gc = {"seq": 3, "kind": "gc", "time": 1.7e9, "token": b"\x44" * 16,
          "packs": [[9, 2048, False, [[oid, 16, 100, 1, 120, []]]]],
          "gone": [7], "swept": [b"\x55" * 16]}
    v2 = [encode_commit(CommitDoc.from_fields(put)), encode_commit(CommitDoc.from_fields(gc))]
    v1 = [msgpack.packb(dict(put, v=1), use_bin_type=True)]
    return v2 + v1 + [b"\x01" + d[HEADER.size:] for d in v2]


def main() -> None:
    import atheris
    from _corpus import with_corpus

    atheris.Setup(with_corpus(sys.argv, "commit", seeds()), check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

"""Damaged commit documents of bucket and shared-directory stores (engine/storage/
commitdoc.py, chain.py, remote.py): a fresh cache rebuilds from the packs and reports the
document, gc deletes nothing it cannot prove dead, only ``commits/<20 digits>`` are
commits, and a document is never read past its size cap. Every test runs on moto and on a
shared directory (the ``bucket`` fixture)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import msgpack
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

import engine  # noqa: E402
from engine.format import commitdoc  # noqa: E402
from engine.storage.shared import SharedBackend  # noqa: E402
from engine.store.commit import chain

GOLDEN = pathlib.Path(__file__).parent / "golden"


def _dag(w, name: str, n: int = 3, size: int = 2000) -> bytes:
    leaves = [w.put(1, os.urandom(size)) for _ in range(n)]
    top = w.put(2, name.encode(), leaves, meta=True)
    w.create_root(name, top)
    return top


def _storage(store):
    return store._core.storage.backend


def _key(seq: int) -> str:
    return f"commits/{seq:020d}"


def _write(store, key: str, data: bytes) -> None:
    """Overwrite (or create) the object ``key`` as a user or a bit flip would."""
    storage = _storage(store)
    if isinstance(storage, SharedBackend):
        path = storage.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        import obstore

        obstore.put(storage.store, key, data)


def _delete(store, key: str) -> None:
    _storage(store).delete(key)


def _body(data: bytes) -> dict:
    """The map of a document of either version (no checks)."""
    if data[:4] == b"\xc1cnc":
        data = data[commitdoc.HEADER.size:]
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _v1(doc: dict) -> bytes:
    return msgpack.packb(dict(doc, v=1), use_bin_type=True)


def _store_with_steps(bucket, tmp_path, url):
    """Three committed roots in three commits, packs small enough that each commit has
    its own; returns the writer's cache (open) and the roots."""
    a = bucket.store(tmp_path / "writer", url, pack_target_size=4096)
    tops = {}
    for i in range(3):
        with a.writer() as w:
            tops[f"step/{i}"] = _dag(w, f"step/{i}")
    return a, tops


def _readable(store, tops) -> None:
    assert store.roots() == tops
    report = store.verify(deep=True)
    assert report.ok, report.problems


def _flip_first_pack_number(data: bytes) -> bytes:
    """Pack number 0 -> 4 in the first entry of ``packs`` (one flipped bit: 0x00 ^ 0x04)."""
    at = data.index(b"\xa5packs")
    at = data.index(b"\x94\x00", at)
    return data[: at + 1] + b"\x04" + data[at + 2 :]


@pytest.mark.parametrize("version", [2, 1])
def test_a_flipped_pack_number_never_loses_a_committed_step(bucket, tmp_path, version):
    # Issue 23 item 2: 0 -> 4 in commit 1's pack list, then gc from a fresh cache. A
    # version-2 document fails its checksum; a version-1 one (no checksum) is applied,
    # and gc's own proof from the packs' trailers keeps pack 0.
    url = bucket.url()
    a, tops = _store_with_steps(bucket, tmp_path, url)
    good = _storage(a).get(_key(1))
    bad = _flip_first_pack_number(good if version == 2 else _v1(_body(good)))
    _write(a, _key(1), bad)
    with bucket.store(tmp_path / "fresh", url) as b:
        if version == 2:
            assert b.roots() == tops
            assert any(_key(1) in p.message for p in b.opened_with_repair.damaged)
        try:
            b.gc(threshold=0.0)
            refused = False
        except engine.StoreError:
            refused = True
    _write(a, _key(1), good)  # the document put back
    with bucket.store(tmp_path / "after", url) as c:
        _readable(c, tops)  # before the fix: pack 0 was deleted, step/0 lost for good
        assert c.opened_with_repair is None
    assert refused
    a.close()


def _gap(store):
    _delete(store, _key(2))


def _doc_edit(**fields):
    def edit(store):
        doc = _body(_storage(store).get(_key(2)))
        doc.update(fields)
        _write(store, _key(2), _v1(doc))
    return edit


def _raw(data: bytes):
    return lambda store: _write(store, _key(2), data)


def _pack_number(n: int):
    def edit(store):
        doc = _body(_storage(store).get(_key(2)))
        doc["packs"][0][0] = n
        _write(store, _key(2), _v1(doc))
    return edit


def _truncate(store):
    _write(store, _key(2), _storage(store).get(_key(2))[:-7])


DAMAGE = {
    "garbage": _raw(b"\x00not a commit at all\xff"),
    "empty": _raw(b""),
    "truncated": _truncate,
    "gap": _gap,
    "wrong-seq": _doc_edit(seq=3),
    "deep-nesting": _raw(b"\x91" * 200_000 + b"\x00"),
    "wrong-type": _doc_edit(packs="not a list"),
    "huge-pack-number": _pack_number(2**32 - 1),  # item 6
    "pack-number-past-names": _pack_number(10**8),
    "integer-root-name": _doc_edit(set={7: b"\x01" * 16}),  # item 13
    "bool-seq": _doc_edit(seq=True),
    "unknown-version": _raw(b"\xc1cnc\x09" + bytes(8) + msgpack.packb({})),
}


# Every kind of damage on a shared directory; on moto (each case ~2 s of HTTP round trips)
# the three that take the rebuild's main paths by default, the rest under -m slow: the
# document's parse is the same code on both.
_ON_MOTO = {"garbage", "gap", "truncated"}
_CASES = [pytest.param(backend, kind, id=f"{backend}-{kind}",
                       marks=(pytest.mark.slow,)
                       if backend == "moto" and kind not in _ON_MOTO else ())
          for backend in ("moto", "shared") for kind in sorted(DAMAGE)]


@pytest.mark.parametrize(("bucket", "damage"), _CASES, indirect=["bucket"])
def test_a_damaged_document_never_stops_a_fresh_cache(bucket, tmp_path, damage):
    # Issue 23 item 4: every pack is whole, so a fresh cache rebuilds from them and
    # names the document; the writer's cache commits on top, and a later fresh cache
    # still reads everything; gc refuses meanwhile, with the engine's error.
    url = bucket.url()
    a, tops = _store_with_steps(bucket, tmp_path, url)
    DAMAGE[damage](a)
    with bucket.store(tmp_path / "fresh", url) as b:
        _readable(b, tops)
        report = b.opened_with_repair
        assert report is not None and any(_key(2) in p.message for p in report.damaged)
        with pytest.raises(engine.GCRefused, match="commit"):
            b.gc(threshold=0.0)
        with b.writer() as w:  # a rebuilt cache commits after the newest document
            tops["step/b"] = _dag(w, "step/b")
    with a.writer() as w:
        tops["step/a"] = _dag(w, "step/a")
    with pytest.raises(engine.GCRefused):
        a.gc(threshold=0.0)  # the writer's own cache sees the damage at gc too
    with bucket.store(tmp_path / "later", url) as c:
        _readable(c, tops)
        report = c.repair()  # repair works on these stores and names the damage
        assert any(_key(2) in p.message for p in report.damaged)
        _readable(c, tops)
    a.close()


def test_a_mended_document_is_read_again_and_gc_runs(bucket, tmp_path):
    url = bucket.url()
    a, tops = _store_with_steps(bucket, tmp_path, url)
    good = _storage(a).get(_key(2))
    _write(a, _key(2), b"junk")
    with bucket.store(tmp_path / "fresh", url) as b:
        assert b.opened_with_repair.damaged
    inode = os.stat(tmp_path / "fresh" / "index" / "data.mdb").st_ino
    with a.writer() as w:
        tops["step/3"] = _dag(w, "step/3")
    with bucket.store(tmp_path / "fresh", url) as b:  # still damaged: not rebuilt again,
        assert any(_key(2) in p.message for p in b.opened_with_repair.damaged)
        _readable(b, tops)  # but newer commits apply
    assert os.stat(tmp_path / "fresh" / "index" / "data.mdb").st_ino == inode
    _write(a, _key(2), good)
    with bucket.store(tmp_path / "fresh", url) as b:  # the same cache, reopened
        _readable(b, tops)
        with b.writer() as w:
            w.delete_root("step/0")
        del tops["step/0"]
        b.gc(threshold=0.0)
        report = b.repair()
        assert report.damaged == ()
        _readable(b, tops)
    a.close()


def test_only_top_level_twenty_digit_keys_are_commits(bucket, tmp_path):
    # Issue 23 item 5: a backup of commits/ kept inside commits/, and a later document of
    # another store there, are never read as commits.
    url, other = bucket.url(), bucket.url()
    a, tops = _store_with_steps(bucket, tmp_path, url)
    with bucket.store(tmp_path / "other", other) as o:
        for i in range(4):
            with o.writer() as w:
                _dag(w, f"other/{i}")
        foreign = _storage(o).get(_key(4))
    with bucket.store(tmp_path / "stale", url) as s:
        assert s.roots() == tops
    for seq in (1, 2, 3):
        _write(a, f"commits/backup/{_key(seq)[8:]}", _storage(a).get(_key(seq)))
        _write(a, f"{_key(seq)}.bak", _storage(a).get(_key(seq)))
    _write(a, "commits/backup/00000000000000000004", foreign)
    _write(a, "commits/x00000000000000000004", foreign)
    with bucket.store(tmp_path / "fresh", url) as b:
        assert b.opened_with_repair is None
        _readable(b, tops)
    with bucket.store(tmp_path / "stale", url) as s:  # an existing cache catching up
        _readable(s, tops)
        assert not any(n.startswith("other/") for n in s.roots())
        s.gc(threshold=0.0)
    a.close()


def test_a_huge_pack_number_never_breaks_later_puts(bucket, tmp_path):
    # Issue 23 item 6, as the writer's own next put and gc see it.
    url = bucket.url()
    a, tops = _store_with_steps(bucket, tmp_path, url)
    _pack_number(2**32 - 1)(a)
    with bucket.store(tmp_path / "fresh", url) as b:
        for i in range(2):
            with b.writer() as w:
                tops[f"new/{i}"] = _dag(w, f"new/{i}")
        with pytest.raises(engine.GCRefused):
            b.gc(threshold=0.0)
        _readable(b, tops)
    a.close()


def test_version_1_stores_keep_opening(tmp_path):
    # A shared-directory store written before commit documents had a checksum (v1),
    # with a gc commit among them.
    shared = tmp_path / "shared"
    shutil.copytree(GOLDEN / "shared_v1", shared)
    tops = {k: bytes.fromhex(v)
            for k, v in json.loads((GOLDEN / "shared_v1_roots.json").read_text()).items()}
    opts = {"gc_grace_s": 0.0}
    with engine.storage_open(os.fspath(shared), cache_dir=tmp_path / "c",
                             storage_options=opts) as s:
        assert s.opened_with_repair is None
        _readable(s, tops)
        with s.writer() as w:
            tops["step/3"] = _dag(w, "step/3")
        s.gc(threshold=0.0)
    docs = sorted((shared / "commits").iterdir())
    assert docs[0].read_bytes()[:1] != b"\xc1" and docs[-1].read_bytes()[:4] == b"\xc1cnc"
    with engine.storage_open(os.fspath(shared), cache_dir=tmp_path / "c2",
                             storage_options=opts) as s:
        assert s.opened_with_repair is None
        _readable(s, tops)


def test_sparse_commit_file_is_never_read(tmp_path):
    # Issue 23 item 9: a commit file claiming 8 GiB (0 bytes on disk): refused by its
    # size before it is read; every command's peak stays small.
    import tracemalloc

    shared = tmp_path / "shared"
    opts = {"gc_grace_s": 0.0}
    with engine.storage_open(os.fspath(shared), cache_dir=tmp_path / "w",
                             storage_options=opts) as a, a.writer() as w:
        top = _dag(w, "step/0")
    for name, size in (("00000000000000000002", 8 << 30),
                       ("00000000000000000003", commitdoc.MAX_COMMIT_BYTES)):
        with open(shared / "commits" / name, "wb") as f:
            f.truncate(size)
    tracemalloc.start()
    try:
        with engine.storage_open(os.fspath(shared), cache_dir=tmp_path / "fresh",
                                 storage_options=opts) as b:
            assert b.roots() == {"step/0": top}
            assert b.opened_with_repair.damaged
            assert b.verify(deep=True).ok
            with pytest.raises(engine.GCRefused):
                b.gc()
            b.repair()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 128 << 20, peak


def test_a_document_over_the_cap_is_refused_before_it_is_published(tmp_path):
    doc = commitdoc.CommitDoc(kind="gc", seq=1,
                              swept=(b"\x01" * 16,) * (commitdoc.MAX_COMMIT_BYTES // 16))
    with pytest.raises(commitdoc.CommitTooLarge, match="nothing was published"):
        commitdoc.encode_commit(doc)


def test_decode_names_the_key_and_checks_the_checksum():
    doc = commitdoc.CommitDoc(kind="gc", seq=5, time=1.5, gone=(3,), swept=(b"\x02" * 16,),
                              token=b"\x03" * 16)
    data = commitdoc.encode_commit(doc)
    assert commitdoc.decode_commit(data, _key(5)) == doc
    flipped = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(engine.CorruptObject, match=f"{_key(5)}.*checksum"):
        commitdoc.decode_commit(flipped, _key(5))
    with pytest.raises(engine.CorruptObject, match="says it is commit 5"):
        commitdoc.decode_commit(data, _key(6))
    header = struct.pack("<4sBQ", b"\xc1cnc", 2, 0)
    with pytest.raises(engine.CorruptObject, match="checksum"):
        commitdoc.decode_commit(header + data[commitdoc.HEADER.size:], _key(5))
    assert commitdoc.seq_of_key(_key(5)) == 5
    for key in ("commits/backup/00000000000000000005", _key(5) + ".bak",
                "commits/0000000000000000000٥", "commits/00000000000000000000"):
        assert commitdoc.seq_of_key(key) is None


def test_cli_repair_works_on_a_shared_store_and_names_the_document(tmp_path, capsys):
    from cnrstore.cli.app import main

    shared = tmp_path / "shared"
    opts = {"gc_grace_s": 0.0}
    with engine.storage_open(os.fspath(shared), cache_dir=tmp_path / "w",
                             storage_options=opts) as a:
        for i in range(2):
            with a.writer() as w:
                _dag(w, f"step/{i}")
    assert main(["repair", os.fspath(shared), "--cache-dir", os.fspath(tmp_path / "c")]) == 0
    capsys.readouterr()
    (shared / "commits" / "00000000000000000001").write_bytes(b"junk")
    code = main(["repair", os.fspath(shared), "--cache-dir", os.fspath(tmp_path / "c"),
                 "--json"])
    out = capsys.readouterr().out
    assert code == 1 and _key(1) in out


def test_an_existing_cache_catching_up_over_a_damaged_document_rebuilds(bucket, tmp_path):
    url = bucket.url()
    a = bucket.store(tmp_path / "writer", url, pack_target_size=4096)
    tops = {}
    with a.writer() as w:
        tops["step/0"] = _dag(w, "step/0")
    with bucket.store(tmp_path / "stale", url) as s:
        assert s.roots() == tops
    for i in (1, 2):
        with a.writer() as w:
            tops[f"step/{i}"] = _dag(w, f"step/{i}")
    _write(a, _key(2), b"\x93junk")
    with bucket.store(tmp_path / "stale", url) as s:
        _readable(s, tops)
        assert any(_key(2) in p.message for p in s.opened_with_repair.damaged)
        with s.writer() as w:
            tops["step/s"] = _dag(w, "step/s")
    a.close()


def test_gc_refuses_when_the_cache_is_ahead_of_the_documents(bucket, tmp_path):
    # The newest document lost (a bucket restored from an older copy): the writer's
    # cache still holds commit 3 and its packs; gc must not act on a view the documents
    # do not prove, nor publish a commit 4 over a missing 3.
    url = bucket.url()
    a, tops = _store_with_steps(bucket, tmp_path, url)
    _delete(a, _key(3))
    with pytest.raises(engine.GCRefused, match="disagree"):
        a.gc(threshold=0.0)
    assert [s for s, _, _ in chain.listed(_storage(a))] == [1, 2]  # nothing published
    _readable(a, tops)
    a.close()


def test_an_oversized_document_is_refused_by_its_listed_size(bucket, tmp_path):
    # Issue 23 item 9 on a bucket: a document over the cap is never downloaded.
    import tracemalloc

    url = bucket.url()
    a, tops = _store_with_steps(bucket, tmp_path, url)
    _write(a, _key(4), b"\x80" * (commitdoc.MAX_COMMIT_BYTES + 1))
    tracemalloc.start()
    try:
        with bucket.store(tmp_path / "fresh", url) as b:
            _readable(b, tops)
            assert any(_key(4) in p.message and "(not read)" in p.message
                       for p in b.opened_with_repair.damaged)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    if isinstance(_storage(a), SharedBackend):  # moto serves from this process's memory
        assert peak < commitdoc.MAX_COMMIT_BYTES // 4, peak
    a.close()


def test_reading_many_small_documents_allocates_what_they_hold(tmp_path):
    # A capped read must not allocate the cap: 16 documents fetched at once would
    # otherwise cost 16 x 12 MiB at every open of a shared-directory store.
    import tracemalloc

    shared, opts = os.fspath(tmp_path / "shared"), {"gc_grace_s": 0.0}
    with engine.storage_open(shared, cache_dir=tmp_path / "w", storage_options=opts) as a:
        for i in range(20):
            with a.writer() as w:
                w.set_root(f"r{i}", w.put(1, os.urandom(100)))
    tracemalloc.start()
    try:
        with engine.storage_open(shared, cache_dir=tmp_path / "fresh",
                                 storage_options=opts) as b:
            assert len(b.roots()) == 20
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak

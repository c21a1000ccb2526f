"""The storage-backend contract (engine/testing/backend.py) over the four backends: a
directory, a shared directory, S3 on moto, memory; and packs built on the smallest of
them, to show that nothing of a pack lives in a backend."""

from __future__ import annotations

import uuid

import pytest

from engine.packs.storage import PackStorage, pack_key
from engine.storage import DirectoryBackend, attach
from engine.storage.memory import MemoryBackend
from engine.storage.shared import SharedBackend
from engine.testing import BackendContract


@pytest.fixture(params=["dir", "shared", "s3", "memory"])
def any_backend(request, tmp_path):
    if request.param == "dir":
        made = DirectoryBackend(tmp_path / "d")
    elif request.param == "shared":
        made = SharedBackend(tmp_path / "s")
    elif request.param == "s3":
        server = request.getfixturevalue("moto_s3")
        (tmp_path / "staging").mkdir()
        made = attach(("s3", f"s3://{server.bucket}/{uuid.uuid4().hex}"),
                      staging=tmp_path / "staging", storage_options=server.options)
    else:
        made = MemoryBackend()
    yield made
    made.close()


class TestBackendContract(BackendContract):
    @pytest.fixture
    def backend(self, any_backend):
        return any_backend


def test_a_store_directory_s_packs_are_keys_below_it(tmp_path):
    """The layout is the one of docs/FORMAT.md "Directory tree": pack N is the file
    ``packs/XX/NNNNNNNN.pack`` and nothing else is written for it."""
    import engine

    with engine.open(tmp_path / "st") as store:
        with store.writer() as w:
            w.create_root("r", w.put(1, b"payload" * 100))
        numbers = sorted(store.storage.sizes())
    files = sorted(p.relative_to(tmp_path / "st").as_posix()
                   for p in (tmp_path / "st" / "packs").rglob("*.pack"))
    assert files == [pack_key(n) for n in numbers] and numbers


def test_packs_over_the_memory_backend_seal_read_and_list():
    from engine.format import records as fmt
    from engine.packs.pack import PackFile, PackReaders

    storage = PackStorage(MemoryBackend())
    pf = PackFile(storage, 5, meta=False)
    offset = pf.append(b"r" * 64, fmt.RECORD_OBJECT, b"\x01" * 32)
    pf.seal()
    pf.sync()
    pf.close()
    with pytest.raises(FileExistsError):
        PackFile(storage, 5, meta=False)  # a number is never written twice
    [entry] = storage.read_trailer(5)
    assert (entry.offset, entry.length, entry.rtype) == (offset, 64, fmt.RECORD_OBJECT)
    assert entry.oid == (b"\x01" * 32)[: len(entry.oid)] and len(entry.oid) >= 16
    assert PackReaders(storage).read(5, offset, 64) == b"r" * 64
    assert list(storage.sizes()) == [5]
    assert storage.delete(5) and storage.sizes() == {}

"""Two caches of one bucket committing at the same moment, at the checkpoint layer (moto):
the loser's put fails whole (WriteFailed caused by ConcurrentCommit, or StepExists for
the same step), its gc raises ConcurrentCommit, and the handle keeps working."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("obstore")
pytest.importorskip("moto")

import cnrstore  # noqa: E402
import engine  # noqa: E402


@pytest.fixture(scope="module")
def moto():
    from _s3 import MotoS3

    server = MotoS3()
    yield server
    server.stop()


def _open(moto, url, cache):
    return cnrstore.open(url, cache_dir=cache, storage_options=moto.options, block_rows=64)


def _interleave(handle, other_commit):
    """Make ``handle``'s next bucket commit lose: ``other_commit`` runs (on another
    cache) right before it creates its commit document."""
    remote = handle.objects._core.log
    original = remote.publish

    def publish(core, base, doc):
        remote.publish = original
        other_commit()
        return original(core, base, doc)

    remote.publish = publish


def test_loser_of_a_put_race_fails_whole_and_recovers(moto, tmp_path):
    url = moto.url()
    t = torch.randn(300, 8)
    a, b = _open(moto, url, tmp_path / "a"), _open(moto, url, tmp_path / "b")
    a.put_tables(1, {"t": t})
    _interleave(b, lambda: a.put_tables(2, {"t": t + 2}))
    with pytest.raises(cnrstore.WriteFailed) as info:
        b.put_tables(3, {"t": t + 3})
    assert isinstance(info.value.__cause__, engine.CommitSequenceTaken)
    assert b.steps() == [1, 2]  # caught up; nothing of step 3
    b.put_tables(3, {"t": t + 3})  # the handle recovers
    _interleave(a, lambda: b.put_tables(4, {"t": t + 4}))
    with pytest.raises(cnrstore.StepExists):
        a.put_tables(4, {"t": t})
    with _open(moto, url, tmp_path / "c") as c:
        assert c.steps() == [1, 2, 3, 4]
        assert torch.equal(c.get_tables(4)["t"], t + 4)
        assert c.verify(deep=True).ok
    a.close()
    b.close()


def test_loser_of_a_gc_race_raises_concurrent_commit(moto, tmp_path):
    url = moto.url()
    t = torch.randn(300, 8)
    a, b = _open(moto, url, tmp_path / "a"), _open(moto, url, tmp_path / "b")
    a.put_tables(1, {"t": t})
    a.put_tables(2, {"t": t + 1})
    b.delete_step(1)
    _interleave(b, lambda: a.put_tables(3, {"t": t + 3}))
    with pytest.raises(cnrstore.ConcurrentCommit):
        b.gc()
    assert b.steps() == [2, 3]  # the cache was rebuilt from the bucket
    b.gc()
    with _open(moto, url, tmp_path / "c") as c:
        assert c.steps() == [2, 3]
        assert c.verify(deep=True).ok
        assert torch.equal(c.get_tables(3)["t"], t + 3)
    a.close()
    b.close()


def test_open_arguments_of_a_location(moto, tmp_path):
    with pytest.raises(cnrstore.InvalidInput, match="cache_dir"):
        cnrstore.open(moto.url(), storage_options=moto.options)
    with pytest.raises(cnrstore.InvalidInput, match="storage_options"):
        cnrstore.open(tmp_path / "dir", storage_options=moto.options)
    # A directory with cache_dir is a shared-directory store (tests/distributed/test_dist_remote.py)
    with cnrstore.open(tmp_path / "dir", cache_dir=tmp_path / "cache") as s:
        assert s.steps() == [] and (tmp_path / "dir" / "commits").is_dir()
    with pytest.raises(cnrstore.StorageError, match="plain http"):
        cnrstore.open(moto.url(), cache_dir=tmp_path / "c",
                      storage_options=dict(moto.options, endpoint="http://10.9.8.7:1"))


def test_open_without_create_where_no_store_is_bad_path(moto, tmp_path):
    # Issue 23 (13): a bucket prefix or a shared directory with no store raised
    # StorageError; like a directory, it is BadPath, and nothing is created.
    url = moto.url()
    with pytest.raises(cnrstore.BadPath, match="no store at"):
        cnrstore.open(url, cache_dir=tmp_path / "cache", create=False,
                      storage_options=moto.options)
    shared = tmp_path / "shared"
    with pytest.raises(cnrstore.BadPath, match="no store at"):
        cnrstore.open(shared, cache_dir=tmp_path / "cache2", create=False)
    assert not shared.exists()
    with _open(moto, url, tmp_path / "cache3") as s:   # the prefix is still free to create
        s.put_tables(0, {"t": torch.ones(4, 2)})

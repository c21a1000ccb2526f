"""``cnrstore export`` and ``import`` on awkward targets and files (issue 23, items 10 and 13):
only a regular file is ever replaced, a missing directory and a failed write are the
library's errors naming the path, and a failed export leaves no partial file behind and the
old file as it was. The write failure is real: the export runs under a file-size limit
(RLIMIT_FSIZE, set around the call), so the kernel refuses the write (EFBIG) as a full
disk refuses it (ENOSPC); both reach the export as an OSError from write(2).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import resource
import signal
import stat

import pytest
import torch

import cnrstore
from cnrstore.cli.app import main
from cnrstore.tools import transfer

pytest.importorskip("safetensors")


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    with cnrstore.open(path, block_rows=64) as s:
        s.put_tables(1, {"user": torch.randn(4096, 16, generator=torch.Generator()
                                             .manual_seed(0))})
    return path


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_force_never_replaces_a_fifo_a_device_or_a_directory(store, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["export", str(store), "1", str(fifo), "--force"]) == 2
    err = _err(capsys)
    assert "is a FIFO" in err and "only regular files" in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    folder = tmp_path / "folder"
    folder.mkdir()
    assert main(["export", str(store), "1", str(folder), "--force"]) == 2
    assert "is a directory" in _err(capsys) and folder.is_dir()
    # A character device of our own (what /dev/null is), not the system's: before the fix
    # the export renamed a regular file over it.
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    assert main(["export", str(store), "1", str(null), "--force"]) == 2
    assert "is a character device" in _err(capsys)
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "null", "pipe", "store"]


def test_force_through_a_symlink_replaces_its_target_and_keeps_the_link(store, tmp_path,
                                                                         capsys):
    real = tmp_path / "real.safetensors"
    real.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(real)
    assert main(["export", str(store), "1", str(link)]) == 2
    assert "pass --force" in _err(capsys)  # the CLI's flag, not the library's keyword
    assert main(["export", str(store), "1", str(link), "--force"]) == 0
    assert link.is_symlink() and real.stat().st_size > 4096 * 16 * 4
    with pytest.raises(cnrstore.BadPath, match="pass overwrite=True"):
        with cnrstore.open(store, readonly=True) as s:
            transfer.export_step(s, 1, real)


def test_export_into_a_missing_directory_is_bad_path(store, tmp_path, capsys):
    target = tmp_path / "no" / "such" / "dir" / "x.safetensors"
    assert main(["export", str(store), "1", str(target)]) == 2
    err = _err(capsys)
    assert "BadPath" in err and str(tmp_path / "no" / "such" / "dir") in err
    assert not (tmp_path / "no").exists()
    with cnrstore.open(store, readonly=True) as s, pytest.raises(cnrstore.BadPath):
        transfer.export_step(s, 1, target)


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Writes past ``limit`` bytes of a file fail with EFBIG, in this process, inside the
    block (SIGXFSZ ignored, so write(2) returns the error instead of killing us)."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_failed_write_leaves_no_partial_file_and_the_old_file_intact(store, tmp_path,
                                                                      capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / "x.safetensors"
    target.write_bytes(b"the previous export")
    with _file_size_limit(64 * 1024):  # the export is 256 KiB
        code = main(["export", str(store), "1", str(target), "--force"])
    assert code == 1
    err = _err(capsys)
    assert "StorageError" in err and str(target) in err and "unchanged" in err
    assert target.read_bytes() == b"the previous export"
    assert [p.name for p in out_dir.iterdir()] == ["x.safetensors"]  # no temporary file
    with cnrstore.open(store, readonly=True) as s, _file_size_limit(64 * 1024):
        with pytest.raises(cnrstore.StorageError, match="File too large"):
            transfer.export_step(s, 1, out_dir / "new.safetensors")
    assert [p.name for p in out_dir.iterdir()] == ["x.safetensors"]
    # Without the limit the same export succeeds over it.
    assert main(["export", str(store), "1", str(target), "--force"]) == 0
    assert transfer._file_metadata(str(target))["cnrstore.step"] == "1"


def _file_with(tmp_path, **meta: str) -> pathlib.Path:
    from safetensors.torch import save_file

    path = tmp_path / "in.safetensors"
    save_file({"user": torch.ones(8, 4)}, str(path), metadata=meta)
    return path


@pytest.mark.parametrize(("key", "value", "says"), [
    ("cnrstore.schemes", json.dumps(["int8"]), "cnrstore.schemes is a JSON list"),
    ("cnrstore.schemes", json.dumps({"user": 8}), "maps 'user' to 8"),
    ("cnrstore.schemes", "{not json", "cnrstore.schemes is not JSON"),
    ("cnrstore.metadata", json.dumps([1, 2]), "cnrstore.metadata is a JSON list"),
])
def test_malformed_cnrstore_metadata_is_invalid_input(store, tmp_path, capsys, key, value,
                                                      says):
    path = _file_with(tmp_path, **{key: value})
    assert main(["import", str(store), "2", str(path)]) == 2
    err = _err(capsys)
    assert says in err and "InvalidInput" in err and str(path) in err
    with cnrstore.open(store, readonly=True) as s:
        assert s.steps() == [1]  # nothing was written

"""Read-only opens (issue 8): ``cnrstore.open(path, readonly=True)`` and the CLI's read
commands read a store whose files cannot be written, and write nothing themselves."""

from __future__ import annotations

import pathlib
import stat

import pytest
import torch

import cnrstore
from cnrstore.cli.app import main
from cnrstore.errors import InvalidInput


def _files(path) -> dict[str, tuple[int, int]]:
    """Every file but LMDB's reader table, with (size, mtime_ns)."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in pathlib.Path(path).rglob("*") if p.is_file() and p.name != "lock.mdb"}


def _chmod_tree(path, writable: bool) -> None:
    for p in [pathlib.Path(path), *pathlib.Path(path).rglob("*")]:
        mode = p.stat().st_mode
        p.chmod(mode | stat.S_IWUSR if writable
                else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture
def frozen(tmp_path):
    path = tmp_path / "ckpt"
    g = torch.Generator().manual_seed(0)
    tables = {"emb": torch.randn(300, 8, generator=g)}
    with cnrstore.open(path, block_rows=32) as s:
        s.put_tables(1, tables)
        tables["emb"][::5] += 1
        s.put_tables(2, tables)
    _chmod_tree(path, writable=False)
    yield path, tables
    _chmod_tree(path, writable=True)


def test_read_only_handle_reads_and_refuses_writes(frozen):
    path, tables = frozen
    before = _files(path)
    with cnrstore.open(path, readonly=True) as s:
        assert s.steps() == [1, 2]
        assert torch.equal(s.get_tables(2)["emb"], tables["emb"])
        assert s.verify().ok
        with pytest.raises(InvalidInput, match="readonly"):
            s.put_tables(3, tables)
        with pytest.raises(InvalidInput, match="readonly"):
            s.delete_step(1)
        with pytest.raises(InvalidInput, match="readonly"):
            s.gc(keep_last=1)
    assert _files(path) == before


@pytest.mark.parametrize("argv", [["ls"], ["show", "2"], ["du"], ["verify"], ["diff", "1", "2"]])
def test_cli_read_commands_open_read_only(frozen, argv, capsys):
    path, _ = frozen
    before = _files(path)
    assert main([argv[0], str(path), *argv[1:]]) == 0
    assert _files(path) == before


def test_cli_export_from_a_read_only_store(frozen, tmp_path):
    path, tables = frozen
    before = _files(path)
    out = tmp_path / "out.safetensors"
    assert main(["export", str(path), "2", str(out)]) == 0
    assert out.exists()
    assert _files(path) == before

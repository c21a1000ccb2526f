"""The exception tree (issue 9): one documented base, engine errors translated at the
boundary with their cause kept, exit codes on the classes."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch

import cnrstore
import engine
from cnrstore import errors
from cnrstore.cli.app import main

PKG = pathlib.Path(cnrstore.__file__).parent


def _public_errors() -> list[type]:
    return [obj for name, obj in vars(errors).items()
            if inspect.isclass(obj) and issubclass(obj, BaseException)
            and not name.startswith("_")]


def test_every_public_error_is_a_checkpoint_error_and_drawn_in_the_docstring():
    classes = _public_errors()
    assert len(classes) >= 20
    for cls in classes:
        assert issubclass(cls, cnrstore.CheckpointError), cls
        assert cls.__name__ in errors.__doc__, f"{cls.__name__} missing from the drawn tree"
        assert cls.exit_code in (errors.EXIT_PROBLEMS, errors.EXIT_USAGE)
        if cls.__name__ in cnrstore.__all__ or cls.__module__ == "cnrstore.errors":
            assert cls.__name__ in errors.__all__


def test_exit_codes_are_the_callers_mistake_or_the_stores_problem():
    usage = (cnrstore.InvalidInput, cnrstore.StepNotFound, cnrstore.TableNotFound,
             cnrstore.BadPath, errors.UsageError, cnrstore.MissingExtra,
             cnrstore.ReadOnlyStore, cnrstore.StepExists)
    problems = (cnrstore.CorruptData, cnrstore.ManifestError, cnrstore.MissingObject,
                cnrstore.StorageError, cnrstore.StoreBusy, cnrstore.WriteFailed,
                cnrstore.CheckpointError)
    assert all(c.exit_code == 2 for c in usage)
    assert all(c.exit_code == 1 for c in problems)
    assert issubclass(cnrstore.ManifestError, cnrstore.CorruptData)  # one "corrupt"


@pytest.mark.parametrize(("exc", "want"), [
    (engine.CorruptObject("bad", oid=b"\1" * 16, pack="p", offset=7), cnrstore.CorruptData),
    (engine.GCRefused("refused", oid=b"\2" * 16), cnrstore.CorruptData),
    (engine.ObjectNotFound("gone", oid=b"\3" * 16), cnrstore.MissingObject),
    (engine.StoreLocked("held"), cnrstore.StoreBusy),
    (engine.ReadOnly("ro"), cnrstore.ReadOnlyStore),
    (engine.StaleIndex("stale"), cnrstore.StorageError),
    (engine.StoreClosed("closed"), cnrstore.StorageError),
    (engine.StoreError("io"), cnrstore.StorageError),
])
def test_translate_keeps_message_location_and_cause(exc, want):
    with pytest.raises(want) as info, errors.engine_errors():
        raise exc
    got = info.value
    assert type(got) is want and isinstance(got, cnrstore.CheckpointError)
    assert got.__cause__ is exc and str(got) == str(exc)
    if isinstance(got, cnrstore.CorruptData):
        assert (got.oid, got.pack, got.offset) == (exc.oid, getattr(exc, "pack", None),
                                                   getattr(exc, "offset", None))


def test_engine_errors_lets_everything_else_through():
    with pytest.raises(cnrstore.StepNotFound), errors.engine_errors():
        raise cnrstore.StepNotFound(3)
    with pytest.raises(ZeroDivisionError), errors.engine_errors():
        1 / 0  # noqa: B018


def _store(path):
    t = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)
    with cnrstore.open(path, block_rows=16) as s:
        s.put_tables(1, {"t": t})
    return t


def _flip(path: pathlib.Path) -> None:
    pack = max(path.glob("packs/*/*.pack"), key=lambda p: p.stat().st_size)
    data = bytearray(pack.read_bytes())
    data[len(data) // 3] ^= 0xFF
    pack.write_bytes(bytes(data))


def test_corrupt_data_through_the_public_api_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "s"
    _store(path)
    _flip(path)
    with cnrstore.open(path) as s, pytest.raises(cnrstore.CheckpointError) as info:
        s.get_tables(1)
    assert isinstance(info.value, cnrstore.CorruptData)
    assert isinstance(info.value.__cause__, engine.StoreError)


def test_a_lost_pack_is_corrupt_data_and_the_cli_says_so(tmp_path, capsys):
    path = tmp_path / "s"
    _store(path)
    for pack in path.glob("packs/*/*.pack"):
        pack.unlink()
    with cnrstore.open(path) as s, pytest.raises(cnrstore.CorruptData):
        s.get_tables(1)
    assert main(["export", str(path), "1", str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cnrstore verify" in err, err


def test_a_busy_store_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "s"
    t = _store(path)
    with cnrstore.open(path, lock_timeout=0.1) as s:
        held = s.objects.writer()
        try:
            with pytest.raises(cnrstore.CheckpointError) as info:
                s.put_tables(2, {"t": t + 1})
        finally:
            held.abort()
    assert isinstance(info.value.__cause__, engine.StoreLocked), info.value


def test_no_other_module_defines_a_public_exception():
    # Errors the codec raises internally are turned into InvalidInput subclasses by the
    # core before they reach a caller (tests/cnrstore/test_value_range.py); Restructure
    # is the distributed put_state's own signal, raised and caught inside it.
    internal = {"RangeError", "NeedsWideQparams", "Restructure"}
    found = []
    for path in PKG.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PKG:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ClassDef) and not node.name.startswith("_")
                    and node.name not in internal
                    and any("Error" in ast.unparse(b) or "Exception" in ast.unparse(b)
                            for b in node.bases)):
                found.append(f"{path.relative_to(PKG)}: {node.name}")
    assert not found, found

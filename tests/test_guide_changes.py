"""docs/GUIDE.md, "Publishing changes": its examples run as written, in a fresh
directory: the Python example, the three commands, and the plain-torch replay of the
file, which must give step 120 from a replica of step 100."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import torch

import cnrstore
from cnrstore.cli.app import main

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "GUIDE.md"


def _section() -> str:
    text = GUIDE.read_text()
    start = text.index("## Publishing changes\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _section(), re.S)


def test_the_guide_examples_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, replay = _blocks("python")
    exec(compile(first, "GUIDE.md: Publishing changes", "exec"), {})
    (commands,) = _blocks("sh")
    for line in commands.strip().splitlines():
        argv = shlex.split(line)
        assert argv[0] == "cnrstore"
        assert main(argv[1:]) == 0, line
    scope: dict = {}
    exec(compile(replay, "GUIDE.md: plain torch", "exec"), scope)
    with cnrstore.open("ckpt/") as store:
        replica, want = store.get_tables(100), store.get_tables(120)
    scope["apply_changes_file"]("changes.safetensors", replica)
    assert sorted(replica) == sorted(want)
    assert all(torch.equal(replica[n], t) for n, t in want.items())
    # The --apply command rewrote the exported replica as step 120 too.
    from safetensors.torch import load_file

    back = load_file("replica.safetensors")
    assert sorted(back) == sorted(want) and all(torch.equal(back[n], want[n]) for n in want)

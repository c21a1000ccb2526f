"""Seed corpora for the atheris targets: written to $TMPDIR/cnrstore-fuzz-corpus/<target>/
unless a corpus folder is given on the command line."""

from __future__ import annotations

import hashlib
import pathlib
import tempfile

CORPUS = pathlib.Path(tempfile.gettempdir()) / "cnrstore-fuzz-corpus"


def with_corpus(argv: list[str], name: str, seeds: list[bytes]) -> list[str]:
    """Return argv with the target's corpus folder added unless one was given; seed it."""
    if any(not a.startswith("-") for a in argv[1:]):
        return argv
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        (folder / hashlib.sha1(seed).hexdigest()).write_bytes(seed)
    return [*argv, str(folder)]

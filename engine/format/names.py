"""Names of pack files: ``packs/XX/NNNNNNNN.pack`` under a store or shared directory, and
finding them on disk by name (docs/FORMAT.md "Directory tree")."""

from __future__ import annotations

import os
import pathlib
import re

_PACK_NAME = re.compile(r"^([0-9]{8})\.pack$")


def pack_name(n: int) -> str:
    """Name used in errors and reports: ``XX/NNNNNNNN.pack`` (FORMAT.md "Directory tree")."""
    return f"{(n >> 8) & 0xFF:02x}/{n:08d}.pack"


def pack_path(root: pathlib.Path, n: int) -> pathlib.Path:
    return root / "packs" / pack_name(n)


def list_pack_files(root: pathlib.Path) -> dict[int, pathlib.Path]:
    """Every ``packs/XX/NNNNNNNN.pack`` on disk, by number (index or not)."""
    found: dict[int, pathlib.Path] = {}
    packs = root / "packs"
    if not packs.is_dir():
        return found
    for sub in packs.iterdir():
        if not sub.is_dir() or not re.fullmatch(r"[0-9a-f]{2}", sub.name):
            continue
        for f in sub.iterdir():
            m = _PACK_NAME.match(f.name)
            if m:
                found[int(m.group(1))] = f
    return found


def pack_numbers(root: pathlib.Path) -> set[int]:
    """The numbers of every ``packs/XX/NNNNNNNN.pack`` on disk: ``list_pack_files``
    without a Path per file (the freshness check runs before every writer)."""
    found: set[int] = set()
    packs = os.path.join(root, "packs")
    try:
        subs = os.listdir(packs)
    except FileNotFoundError:
        return found
    for sub in subs:
        if len(sub) != 2 or sub.strip("0123456789abcdef"):
            continue
        try:
            names = os.listdir(os.path.join(packs, sub))
        except (NotADirectoryError, FileNotFoundError):
            continue
        for name in names:
            if len(name) == 13 and name.endswith(".pack") and name[:8].isdigit():
                found.add(int(name[:8]))
    return found

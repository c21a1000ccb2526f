"""How many modules a put (and a get) walks through: issue 24's measure of a pipeline
that a newcomer can follow.

A profiler hook (``sys.setprofile`` and ``threading.setprofile``, so the writer thread
and the decode pool count too) follows which module of cnrstore/ is executing at every
call and return of a Python function; per thread the sequence is folded into *stays*
(maximal runs in one module). Reported: the stays, the distinct modules, and the
*returns* (stays in a module the thread had already left: stays minus modules, summed
over threads). Frames outside cnrstore/ (the engine, torch, the standard library) do not
change the module, so the figures are about cnrstore's own layering; ``--with-engine``
counts engine/ modules too.

    .venv/bin/python benches/put_modules.py            # a 2-table incremental put + get

Deterministic for a given tree (no timing involved); run it on two trees to compare.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def _module_of(filename: str, roots: tuple[str, ...]) -> str | None:
    path = Path(filename)
    try:
        rel = path.resolve().relative_to(REPO)
    except ValueError:
        return None
    if not rel.parts or rel.parts[0] not in roots:
        return None
    return ".".join(rel.with_suffix("").parts)


class Tracer:
    """The hook, installed before the store is opened (its writer thread and decode pool
    start with it: Python 3.11 cannot hook threads already running), recording only
    while ``measure`` runs."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots
        self.active = False
        self.runs: dict[int, list[str]] = {}
        self._cache: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def hook(self, frame: Any, event: str, _arg: Any) -> None:
        if not self.active:
            return
        if event == "call":
            code = frame.f_code
        elif event == "return":
            if frame.f_back is None:
                return
            code = frame.f_back.f_code
        else:
            return
        name = code.co_filename
        if name not in self._cache:
            self._cache[name] = _module_of(name, self.roots)
        mod = self._cache[name]
        if mod is None:
            return
        with self._lock:
            seq = self.runs.setdefault(threading.get_ident(), [])
            if not seq or seq[-1] != mod:
                seq.append(mod)

    def __enter__(self) -> Tracer:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def measure(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """``fn()`` traced: the figures of every thread that ran cnrstore code in it."""
        self.runs = {}
        self.active = True
        try:
            fn()
        finally:
            self.active = False
        runs = self.runs
        entered: dict[str, int] = {}
        for s in runs.values():
            for m in s:
                entered[m] = entered.get(m, 0) + 1
        return {"stays": sum(len(s) for s in runs.values()),
                "modules": len({m for s in runs.values() for m in s}),
                "returns": sum(len(s) - len(set(s)) for s in runs.values()),
                "threads": len(runs),
                "entries": dict(sorted(entered.items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--with-engine", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    roots = ("cnrstore", "engine") if args.with_engine else ("cnrstore",)

    import cnrstore

    g = torch.Generator().manual_seed(0)
    tables = {"emb": torch.randn(4096, 16, generator=g),
              "dense": torch.randn(64, 8, generator=g)}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="put-modules-") as tmp, Tracer(roots) as tr:
        with cnrstore.open(Path(tmp) / "s", block_rows=256, decode_threads=1) as s:
            s.put_tables(1, tables, quant={"emb": "int8"})   # warm: imports, first put
            s.get_tables(1)
            tables["emb"][:40] += 1.0
            out["put"] = tr.measure(lambda: s.put_tables(2, tables, quant={"emb": "int8"}))
            out["get"] = tr.measure(lambda: s.get_tables(2))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for what, r in out.items():
            print(f"{what}: {r['stays']} stays in {r['modules']} modules, "
                  f"{r['returns']} returns to a module already left "
                  f"({r['threads']} threads)")
            print("   entries: " + ", ".join(f"{m.removeprefix('cnrstore.')} {n}"
                                             for m, n in r["entries"].items()))
    return out


if __name__ == "__main__":
    main()

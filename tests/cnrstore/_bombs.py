"""Crafted stores of a few KB whose nodes or blocks decompress or decode to hundreds of
MiB (issue 23), and a probe that runs one command on such a store in a fresh interpreter
and measures its peak RSS growth.

Every bomb here is a real object under its real id, written through the engine's own
writer: only what the payload claims is a lie (a list of 32 M entries where a segment
holds one block, a full block of 1 GiB where the table's block holds 8 rows)."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys

import msgpack
import torch

import cnrstore
import engine
from cnrstore.format.blocks import KIND_BLOCK_FULL, KIND_BLOCK_PATCH
from cnrstore.format.load import load_manifest
from cnrstore.format.manifest import FORMAT_VERSION, KIND_SEGMENT, KIND_STEP, KIND_TABLE, root_name

# Elements of the msgpack array a node bomb carries: 32 M small ints are a 32 MiB payload
# (one byte each) that zstd keeps in ~1 KB, and a 256 MiB list once unpacked.
BOMB_LEN = 32 << 20
BLOCK_ROWS, FANOUT, WIDTH = 8, 4, 4   # the healthy table of step 1: 8 rows of 4 fp32


def _array(n: int) -> bytes:
    """A msgpack array of ``n`` zeros, built without a Python list of ``n`` entries."""
    return b"\xdd" + struct.pack(">I", n) + bytes(n)


def _map(items: list[tuple[str, bytes]]) -> bytes:
    """A msgpack map from keys and already packed values."""
    head = bytes([0x80 | len(items)])
    return head + b"".join(msgpack.packb(k) + v for k, v in items)


def _pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def healthy(path) -> None:
    """Step 1: one 8 x 4 fp32 table "t" in one block of one segment."""
    with cnrstore.open(path, block_rows=BLOCK_ROWS, fanout=FANOUT) as s:
        s.put_tables(1, {"t": torch.arange(32, dtype=torch.float32).reshape(8, 4)})


def _write_step(w: engine.Writer, step1, table_id: bytes, **changes) -> None:
    node = dataclasses.replace(step1, step=2, table_ids=(table_id,), **changes)
    payload, refs = node.encode()
    w.set_root(root_name(2), w.put(KIND_STEP, payload, refs, meta=True))


def _table(w: engine.Writer, tnode, segment_ids: tuple[bytes, ...]) -> bytes:
    payload, refs = dataclasses.replace(tnode, segment_ids=segment_ids).encode()
    return w.put(KIND_TABLE, payload, refs, meta=True)


def _segment(w: engine.Writer, block: bytes) -> bytes:
    payload = _pack({"v": FORMAT_VERSION, "depth": [0], "chain_bytes": [0]})
    return w.put(KIND_SEGMENT, payload, (block,), meta=True)


def craft(path, kind: str) -> None:
    """A store at ``path``: healthy step 1 and step 2 carrying bomb ``kind`` (BOMBS)."""
    healthy(path)
    with engine.open(path, compression_level=3) as objects:
        m = load_manifest(objects, 1)
        tm = m.tables["t"]
        block = tm.block_ids[0]
        with objects.writer() as w:
            if kind == "segment-depth":
                payload = _map([("v", _pack(FORMAT_VERSION)), ("depth", _array(BOMB_LEN)),
                                ("chain_bytes", _pack([0]))])
                seg = w.put(KIND_SEGMENT, payload, (block,), meta=True)
                _write_step(w, m.node, _table(w, tm.node, (seg,)))
            elif kind == "table-shape":
                doc = dataclasses.replace(tm.node).encode()[0]
                fields = msgpack.unpackb(doc)
                items = [(k, _pack(v)) for k, v in fields.items() if k != "shape"]
                items.append(("shape", b"\xdd" + struct.pack(">I", BOMB_LEN + 2)
                              + _pack(8) + _pack(4) + b"\x01" * BOMB_LEN))
                tid = w.put(KIND_TABLE, _map(items), tm.node.segment_ids, meta=True)
                _write_step(w, m.node, tid)
            elif kind == "step-metadata":
                doc = msgpack.unpackb(m.node.encode()[0])
                doc["step"] = 2
                items = [(k, _pack(v)) for k, v in doc.items() if k != "metadata"]
                items.append(("metadata", _map([("m", _array(BOMB_LEN))])))
                w.set_root(root_name(2), w.put(KIND_STEP, _map(items), m.node.table_ids,
                                               meta=True))
            elif kind == "block-full":
                # A full block that says (and holds) 16 Mi rows of 16 bytes: 256 MiB of
                # zeros under its true id, where the table's block holds 8 rows.
                rows, rnb = 1 << 24, tm.node.row_nbytes
                head = struct.pack("<4sBBHII", b"CNRB", 2, 2, 1, rows, rnb)
                big = w.put(KIND_BLOCK_FULL, head + bytes(rows * rnb))
                _write_step(w, m.node, _table(w, tm.node, (_segment(w, big),)))
            elif kind == "block-patch":
                # A patch on the healthy block that claims 16 Mi changed rows.
                n, rnb = 1 << 24, tm.node.row_nbytes
                head = struct.pack("<4sBBHIII", b"CNRP", 2, 2, 1, BLOCK_ROWS, rnb, n)
                big = w.put(KIND_BLOCK_PATCH, head + bytes(n * (2 + rnb)), (block,))
                _write_step(w, m.node, _table(w, tm.node, (_segment(w, big),)))
            else:
                raise ValueError(kind)


BOMBS = ("segment-depth", "table-shape", "step-metadata", "block-full", "block-patch")


def store_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(os.path.join(path, "packs")) for f in files)


# Commands on the store at sys.argv[1] in this fresh interpreter, one after the other:
# for each, its peak RSS growth from just before it runs (the kernel's high-water mark
# reset through clear_refs; large buffers are mmapped and go back to the kernel when
# freed, so one command's garbage does not hide the next one's growth), and what it
# raised or returned.
_PROBE = r"""
import json, sys
import cnrstore, torch
from cnrstore.cli.app import main

path, commands = sys.argv[1], sys.argv[2:]

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

def run(command):
    if command.startswith("cli "):
        return main(command.format(store=path).split()[1:])
    with cnrstore.open(path, create=False) as s:
        if command == "get":
            return s.get_tables(2)
        if command == "get_state":
            return s.get_state(2)
        if command == "metadata":
            return s.metadata(2)
        if command == "verify":
            return s.verify(deep=True)
        raise ValueError(command)

# Imports and first-use allocations out of the way before anything is measured.
with cnrstore.open(path, create=False) as s:
    s.get_tables(1)
for command in commands:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    out = {"command": command, "error": None, "message": "", "result": None}
    result = None
    try:
        result = run(command)
        out["result"] = result if isinstance(result, int) else type(result).__name__
        if hasattr(result, "problems"):
            out["problems"] = [str(p) for p in result.problems]
    except Exception as exc:
        out["error"] = type(exc).__name__
        out["message"] = str(exc)
        out["bases"] = [c.__name__ for c in type(exc).__mro__]
    out["growth"] = status("VmHWM") - before
    result = None
    print("PROBE " + json.dumps(out), flush=True)
"""


def probe(path, *commands: str, timeout: float = 300) -> list[dict]:
    """Run ``commands`` ("get", "get_state", "metadata", "verify", or "cli ARGS" with
    ``{store}`` standing for the store) on the store at ``path`` in one fresh interpreter;
    a report per command: growth (bytes), error class, its bases and message, result
    (an int for the CLI: its exit code), problems (of a verify), the CLI's stderr."""
    cmd = [sys.executable, "-c", _PROBE, os.fspath(path), *commands]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    reports = [json.loads(line[6:]) for line in out.stdout.splitlines()
               if line.startswith("PROBE ")]
    if len(reports) != len(commands):
        raise AssertionError(f"probe died (rc {out.returncode}) after {len(reports)} of "
                             f"{commands}: {out.stdout[-2000:]}{out.stderr[-4000:]}")
    for r in reports:
        r["stderr"] = out.stderr
    return reports

"""How objects travel between ranks and the coordinator's store.

A rank never opens the LMDB index: it writes the objects of its blocks into pack files
whose numbers the coordinator reserved (``engine.PackSink``) and reports their locations;
the coordinator adopts them into its commit. For a read, the coordinator sends the
locations of the records a rank needs and the rank reads them from the pack files
(``engine.LocatedObjects``), so core/restore.py runs unchanged on it.

While the engine lacks those (``_LOCATED`` false) the bytes themselves travel through the
process group: same protocol, same objects, only slower.
"""

from __future__ import annotations

import os
from typing import Any

import engine
from engine import Object, ObjectStore, object_id

__all__ = ["Uploader", "grants", "adopt", "missing", "locate", "reader"]

_LOCATED = all(hasattr(engine, n) for n in ("PackSink", "LocatedReader", "LocatedObjects",
                                              "RecordLocation"))
_PACK_BYTES = 64 << 20   # reservation estimate per pack (the engine's target size or less)


def missing(objects: ObjectStore, oids: list[bytes]) -> set[bytes]:
    """Those of ``oids`` the coordinator's store lacks."""
    fn = getattr(objects, "missing", None)
    if _LOCATED and fn is not None:
        return set(fn(oids))
    return {o for o in oids if not objects.has(o)}


def grants(objects: ObjectStore, nbytes: list[int]) -> list[Any]:
    """Per rank, what its Uploader may write into: reserved pack numbers, or inline."""
    if not _LOCATED or not hasattr(objects, "reserve_packs"):
        return [("inline",) for _ in nbytes]
    target = getattr(getattr(objects, "options", None), "pack_target_size", _PACK_BYTES)
    out = []
    for n in nbytes:
        k = (n // max(1, target) + 2) if n else 0
        packs = objects.reserve_packs(k) if k else range(0)
        out.append(("packs", os.fspath(objects.path), packs,
                    getattr(objects, "options", None)))
    return out


class Uploader:
    """A rank's side of one put: ``put`` the objects assigned to it, ``seal`` returns what
    the coordinator adopts (locations, or the objects inline)."""

    def __init__(self, grant: Any):
        self._grant = grant
        self._inline: list[tuple[int, tuple[bytes, ...], bytes]] = []
        self._sink = None
        if grant[0] == "packs" and len(grant[2]):
            _, path, packs, options = grant
            self._sink = engine.PackSink(path, packs, options)

    def put(self, kind: int, payload: bytes, refs: tuple[bytes, ...]) -> None:
        if self._sink is not None:
            self._sink.put(kind, payload, refs)
        else:
            self._inline.append((kind, tuple(refs), bytes(payload)))

    def seal(self) -> Any:
        if self._sink is not None:
            return ("locs", [loc.to_wire() for loc in self._sink.seal()])
        return ("inline", self._inline)

    def discard(self) -> None:
        if self._sink is not None:
            self._sink.discard()


def adopt(w: Any, sealed: list[Any]) -> tuple[int, int]:
    """Add every rank's sealed objects to the coordinator's transaction ``w``; return
    (record bytes, payload bytes) the ranks wrote."""
    written = payload = 0
    locs = []
    for kind, data in sealed:
        if kind == "locs":
            for wire in data:
                loc = engine.RecordLocation.from_wire(wire)
                locs.append(loc)
                written += loc.length
                payload += loc.raw_len
        else:
            for k, refs, p in data:
                w.put(k, p, refs)
                payload += len(p)
    if locs:
        w.adopt(locs)
    return written, payload


def locate(objects: ObjectStore, oids: list[bytes]) -> Any:
    """What a rank needs to read ``oids`` and the patch chains under them."""
    if _LOCATED and hasattr(objects, "locate_closure"):
        return ("locs", os.fspath(objects.path),
                [loc.to_wire() for loc in objects.locate_closure(oids)])
    seen: dict[bytes, tuple] = {}
    todo = list(oids)
    while todo:
        oid = todo.pop()
        if oid in seen:
            continue
        obj = objects.get(oid)
        seen[oid] = (obj.kind, obj.refs, obj.payload)
        todo.extend(obj.refs)
    return ("inline", seen)


class _Inline:
    """The objects of an inline answer, read like a store (``get``; ids re-checked)."""

    def __init__(self, objs: dict[bytes, tuple]):
        self._objs = objs

    def get(self, oid: bytes) -> Object:
        from cnrstore.errors import MissingObject

        if oid not in self._objs:
            raise MissingObject(f"object {oid.hex()} was not sent to this rank", oid=oid)
        kind, refs, payload = self._objs[oid]
        if object_id(kind, refs, payload) != oid:
            from cnrstore.errors import CorruptData

            raise CorruptData(f"object {oid.hex()} arrived damaged", oid=oid)
        return Object(kind, tuple(refs), payload)


def reader(answer: Any) -> Any:
    """An object source (``get``) for a rank from ``locate``'s answer."""
    if answer[0] == "locs":
        _, path, wires = answer
        locs = [engine.RecordLocation.from_wire(w) for w in wires]
        return engine.LocatedObjects(engine.LocatedReader(path), locs)
    return _Inline(answer[1])

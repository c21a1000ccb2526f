"""Commit documents of bucket and shared-directory stores: their keys, their encoding and
a strict decoder (docs/FORMAT.md "Object stores", "Commit documents").

A document is ``MAGIC | version u8 | xxh3_64(body) u64 | body`` (version 2), the body a
msgpack map. Version-1 documents (a bare msgpack map, no checksum) are still read. 0xc1 is
a byte msgpack never emits, so no version-1 document starts like a version-2 one.

Every field is checked for type and range before a cache applies anything, so a damaged
document raises CorruptObject naming its key, never a foreign exception and never an
entry the index cannot hold (a pack number past the pack names' 8 digits, a root name
that is not a str).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import xxhash

from ..errors import CorruptObject, StoreError
from .ids import ID_SIZE, MAX_ROOT_NAME

COMMITS = "commits/"
MAGIC = b"\xc1cnc"
VERSION = 2
HEADER = struct.Struct("<4sBQ")
# Bounds what one open reads and decodes per document: a document decodes to at most
# ~8 bytes of Python references per byte (an array of fixints), so one in flight stays
# under ~110 MiB even when crafted. Documents are fetched so that at most this many bytes
# are in flight at once.
MAX_COMMIT_BYTES = 12 << 20
MAX_PACK = 10**8 - 1          # pack names have 8 decimal digits (FORMAT.md "Directory tree")
MAX_SEQ = 10**20 - 1          # commit keys have 20
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_KINDS = ("put", "gc")
_KEYS = {"v", "seq", "kind", "time", "packs", "gone", "swept", "set", "del", "creates",
         "token"}


def commit_key(seq: int) -> str:
    return f"{COMMITS}{seq:020d}"


def seq_of_key(key: str) -> int | None:
    """S for exactly ``commits/<S as 20 digits>``, S >= 1; None for any other key (a
    nested copy ``commits/backup/…``, a suffix, a temp file): those are never commits."""
    if not key.startswith(COMMITS):
        return None
    name = key[len(COMMITS):]
    if len(name) != 20 or not name.isascii() or not name.isdigit():
        return None
    seq = int(name)
    return seq if seq >= 1 else None


class EntryDoc(NamedTuple):
    """One object record a document lists: ``[id, offset, length, kind, raw_len, refs]``."""

    oid: bytes
    offset: int
    length: int
    kind: int
    raw_len: int
    refs: tuple[bytes, ...]


class PackDoc(NamedTuple):
    """One pack a commit adds: ``[number, size, meta, entries]``."""

    number: int
    size: int
    meta: bool
    entries: tuple[EntryDoc, ...]


@dataclass(frozen=True)
class CommitDoc:
    """One commit as its document records it: a writer's put (packs, roots set and
    deleted, names created) or a gc (packs written, packs gone, objects swept). The only
    form a commit document takes in the engine; ``fields`` is its msgpack body."""

    kind: str                                   # "put" or "gc"
    packs: tuple[PackDoc, ...] = ()
    gone: tuple[int, ...] = ()                  # packs a gc retired
    swept: tuple[bytes, ...] = ()               # ids a gc dropped
    sets: Mapping[str, bytes] = field(default_factory=dict)  # roots set: name -> id
    deletes: tuple[str, ...] = ()               # roots deleted
    creates: tuple[str, ...] = ()               # roots created (create_root)
    seq: int = 0                                # set when it is published
    time: float = 0.0
    token: bytes | None = None                  # tells a writer its own document

    def fields(self) -> dict[str, Any]:
        """The body's map, fields in the order writers always wrote them (a field of the
        other kind only when it holds something)."""
        gc = {"gone": list(self.gone), "swept": list(self.swept)}
        put = {"set": dict(self.sets), "del": list(self.deletes),
               "creates": list(self.creates)}
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "gc":
            out.update(gc, packs=list(self.packs), **{k: v for k, v in put.items() if v})
        else:
            out.update(packs=list(self.packs), **put, **{k: v for k, v in gc.items() if v})
        out.update(seq=self.seq, time=self.time)
        if self.token is not None:
            out["token"] = self.token
        return out

    @classmethod
    def from_fields(cls, doc: Mapping[str, Any]) -> CommitDoc:
        """The document a decoded (and checked) body describes; absent fields are empty."""
        return cls(
            kind=doc["kind"],
            packs=tuple(PackDoc(n, size, meta, tuple(EntryDoc(o, off, ln, k, raw, tuple(refs))
                                                     for o, off, ln, k, raw, refs in entries))
                        for n, size, meta, entries in doc.get("packs", ())),
            gone=tuple(doc.get("gone", ())), swept=tuple(doc.get("swept", ())),
            sets=dict(doc.get("set", {})), deletes=tuple(doc.get("del", ())),
            creates=tuple(doc.get("creates", ())), seq=doc["seq"], time=doc["time"],
            token=doc.get("token"))


class CommitTooLarge(StoreError):
    """A commit's document would exceed MAX_COMMIT_BYTES: nothing was published."""


def encode_commit(doc: CommitDoc) -> bytes:
    body = msgpack.packb(dict(doc.fields(), v=VERSION), use_bin_type=True)
    data = HEADER.pack(MAGIC, VERSION, xxhash.xxh3_64_intdigest(body)) + body
    if len(data) > MAX_COMMIT_BYTES:
        raise CommitTooLarge(
            f"commit {doc.seq} would need a {len(data)}-byte commit document, more "
            f"than the {MAX_COMMIT_BYTES} a store may hold (about 350,000 objects): "
            "nothing was published; put the tables in several commits")
    return data


def decode_commit(data: bytes, key: str) -> CommitDoc:
    """The validated document at ``key`` (its sequence must be the key's)."""
    def bad(why: str) -> CorruptObject:
        return CorruptObject(f"commit document {key} is damaged: {why}", pack=key)

    if len(data) > MAX_COMMIT_BYTES:
        raise bad(f"{len(data)} bytes, more than the {MAX_COMMIT_BYTES} a document may have")
    if data[:len(MAGIC)] == MAGIC:
        if len(data) < HEADER.size:
            raise bad("truncated header")
        _, version, stored = HEADER.unpack_from(data)
        if version != VERSION:
            raise bad(f"unknown document version {version}")
        body = memoryview(data)[HEADER.size:]
        if xxhash.xxh3_64_intdigest(body) != stored:
            raise bad("checksum mismatch")
    else:
        version, body = 1, memoryview(data)
    try:
        doc = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True,
                              max_bin_len=ID_SIZE, max_str_len=4 * MAX_ROOT_NAME,
                              max_ext_len=0)
    except Exception as exc:  # msgpack raises a zoo of types (and RecursionError) on junk
        raise bad(f"{type(exc).__name__}: {exc}"[:200]) from None
    try:
        _check(doc, version, seq_of_key(key))
    except _Bad as exc:
        raise bad(str(exc)) from None
    return CommitDoc.from_fields(doc)


class _Bad(Exception):
    pass


def _show(v: Any) -> str:
    """A short account of ``v`` (never the repr of a huge list)."""
    if v is None or isinstance(v, (bool, int, float)):
        return repr(v)[:40]
    if isinstance(v, (str, bytes)):
        return repr(v[:40])
    return f"a {type(v).__name__} of {len(v)}" if hasattr(v, "__len__") else type(v).__name__


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _Bad(f"{what} {_show(v)} is not an integer in {lo}..{hi}")
    return v


def _list(v: Any, what: str) -> list:
    if not isinstance(v, list):
        raise _Bad(f"{what} is a {type(v).__name__}, not a list")
    return v


def _id(v: Any, what: str) -> bytes:
    if not isinstance(v, bytes) or len(v) != ID_SIZE:
        raise _Bad(f"{what} {_show(v)} is not a {ID_SIZE}-byte id")
    return v


def _name(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise _Bad(f"{what} {_show(v)} is a {type(v).__name__}, not a str")
    try:
        n = len(v.encode("utf-8"))
    except UnicodeEncodeError:
        raise _Bad(f"{what} {_show(v)} is not valid unicode") from None
    if not 0 < n <= MAX_ROOT_NAME:
        raise _Bad(f"{what} {_show(v)} is not 1..{MAX_ROOT_NAME} utf-8 bytes")
    return v


def _check(doc: Any, version: int, key_seq: int | None) -> None:
    if not isinstance(doc, dict):
        raise _Bad(f"a {type(doc).__name__}, not a map")
    unknown = [k for k in doc if k not in _KEYS]
    if unknown:
        raise _Bad(f"unknown fields {[_show(k) for k in unknown[:5]]}")
    if doc.get("v") != version or isinstance(doc.get("v"), bool):
        raise _Bad(f"field v is {_show(doc.get('v'))}, its encoding says version {version}")
    seq = _int(doc.get("seq"), 1, MAX_SEQ, "seq")
    if key_seq is not None and seq != key_seq:
        raise _Bad(f"it says it is commit {seq}")
    if doc.get("kind") not in _KINDS:
        raise _Bad(f"kind {_show(doc.get('kind'))} is not one of {_KINDS}")
    t = doc.get("time")
    if (not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t)
            or t < 0):
        raise _Bad(f"time {_show(t)} is not a finite non-negative number")
    if "token" in doc:
        _id(doc["token"], "token")
    for p in _list(doc.get("packs", []), "packs"):
        if not isinstance(p, list) or len(p) != 4:
            raise _Bad(f"pack {_show(p)} is not [number, size, meta, entries]")
        n, size, meta, entries = p
        _int(n, 0, MAX_PACK, "pack number")
        _int(size, 0, _U64, f"size of pack {n}")
        if not isinstance(meta, bool):
            raise _Bad(f"meta flag of pack {n} is not a bool")
        for e in _list(entries, f"entries of pack {n}"):
            if not isinstance(e, list) or len(e) != 6:
                raise _Bad(f"an entry of pack {n} is not [id, offset, length, kind, raw_len,"
                           " refs]")
            oid, offset, length, kind, raw_len, refs = e
            _id(oid, f"object id in pack {n}")
            _int(offset, 0, _U64, "offset")
            _int(length, 0, _U64, "length")
            _int(kind, 0, 255, "kind")
            _int(raw_len, 0, _U64, "raw_len")
            for r in _list(refs, "refs"):
                _id(r, "ref")
            if len(refs) > _U32:
                raise _Bad("too many refs")
    for n in _list(doc.get("gone", []), "gone"):
        _int(n, 0, MAX_PACK, "gone pack number")
    for oid in _list(doc.get("swept", []), "swept"):
        _id(oid, "swept id")
    roots = doc.get("set", {})
    if not isinstance(roots, dict):
        raise _Bad("set is not a map")
    for name, target in roots.items():
        _name(name, "root name")
        _id(target, f"target of root {_show(name)}")
    for listed in ("del", "creates"):
        for name in _list(doc.get(listed, []), listed):
            _name(name, f"root name in {listed}")

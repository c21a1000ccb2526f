"""Payloads of roots records (docs/FORMAT.md "Roots snapshots").

Type 1 is a full snapshot of every root; type 2 a delta naming the roots one commit set
and deleted. Repair replays the newest full snapshot and the deltas after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from ..errors import CorruptObject
from .ids import ID_SIZE, object_id

RECORD_ROOTS = 1        # a full roots snapshot
RECORD_ROOTS_DELTA = 2  # the roots one commit set and deleted, on top of sequence seq - 1
ROOTS_RECORDS = (RECORD_ROOTS, RECORD_ROOTS_DELTA)


def snapshot_id(payload: bytes) -> bytes:
    """Id of a roots-snapshot record: its payload hashed as a kind-0 object without refs."""
    return object_id(0, (), payload)


def encode_snapshot(seq: int, roots: dict[str, bytes]) -> bytes:
    return msgpack.packb({"seq": seq, "roots": dict(sorted(roots.items()))}, use_bin_type=True)


def encode_delta(seq: int, changes: dict[str, bytes | None]) -> bytes:
    """Payload of a roots delta: names set (to ids) and deleted by commit ``seq``."""
    sets = {k: v for k, v in sorted(changes.items()) if v is not None}
    dels = sorted(k for k, v in changes.items() if v is None)
    return msgpack.packb({"seq": seq, "set": sets, "del": dels}, use_bin_type=True)


@dataclass(frozen=True)
class RootsRecord:
    seq: int
    full: bool                    # a full snapshot (roots = every root) or a delta
    roots: dict[str, bytes]       # full: the root map; delta: the names set
    deleted: tuple[str, ...] = ()  # delta only

    def apply(self, roots: dict[str, bytes]) -> dict[str, bytes]:
        """The root map after this record, given the map of sequence ``seq - 1``."""
        if self.full:
            return dict(self.roots)
        out = dict(roots)
        for name in self.deleted:
            out.pop(name, None)
        out.update(self.roots)
        return out


def _is_roots(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, bytes) and len(v) == ID_SIZE
        for k, v in value.items())


def decode_roots_record(payload: bytes, rtype: int = RECORD_ROOTS, *, pack: str | None = None,
                        offset: int | None = None) -> RootsRecord:
    """Decode the payload of a type-1 (full) or type-2 (delta) roots record."""
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        seq = doc["seq"]
        if rtype == RECORD_ROOTS:
            rec = RootsRecord(seq, True, doc["roots"])
            ok = _is_roots(rec.roots)
        else:
            rec = RootsRecord(seq, False, doc["set"], tuple(doc["del"]))
            ok = _is_roots(rec.roots) and all(isinstance(k, str) for k in rec.deleted)
        ok = ok and isinstance(seq, int) and 0 <= seq < 1 << 64
    except Exception as exc:  # msgpack raises a zoo of types on junk
        raise CorruptObject(f"pack {pack} offset {offset}: bad roots record: {exc}",
                            pack=pack, offset=offset) from exc
    if not ok:
        raise CorruptObject(f"pack {pack} offset {offset}: malformed roots record",
                            pack=pack, offset=offset)
    return rec


def decode_snapshot(payload: bytes, *, pack: str | None = None,
                    offset: int | None = None) -> tuple[int, dict[str, bytes]]:
    """(seq, roots) of a full snapshot payload."""
    rec = decode_roots_record(payload, RECORD_ROOTS, pack=pack, offset=offset)
    return rec.seq, rec.roots

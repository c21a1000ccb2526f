"""Objects in this process's memory: the smallest backend that keeps the contract
(engine/testing/backend.py), for tests and for stores that need nothing durable."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from .base import KeyInfo, KeyWriter, ObjectBackend, check_key


class MemoryWriter(KeyWriter):
    """An object gathered in memory and stored under its key at ``finish``."""

    path = None

    def __init__(self, backend: MemoryBackend, key: str) -> None:
        self._backend = backend
        self._key = key
        self._parts: list[bytes] = []
        self._closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._parts.append(bytes(data))

    def writev(self, parts: Sequence[bytes | memoryview]) -> int:
        data = b"".join(parts)
        self._parts.append(data)
        return len(data)

    def finish(self) -> None:
        self._backend.put(self._key, b"".join(self._parts))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._parts = []

    def discard(self) -> None:
        self.close()
        self._backend.delete(self._key)


class MemoryBackend(ObjectBackend):
    """A dict of key -> (bytes, Unix time written), behind one lock."""

    remote = True  # no files: reads are ranged gets

    def __init__(self) -> None:
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._writing: set[str] = set()
        self._lock = threading.Lock()

    def _get(self, key: str) -> tuple[bytes, float]:
        with self._lock:
            try:
                return self._objects[check_key(key)]
            except KeyError:
                raise FileNotFoundError(f"{key}: no such object in memory") from None

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        data = self._get(key)[0]
        return data if limit is None else data[: limit + 1]

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._get(key)[0][offset : offset + max(length, 0)]

    def head(self, key: str) -> KeyInfo:
        data, modified = self._get(key)
        return KeyInfo(key, len(data), modified, len(data))

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._objects[check_key(key)] = (bytes(data), time.time())

    def put_if_absent(self, key: str, data: bytes) -> None:
        with self._lock:
            if check_key(key) in self._objects:
                raise FileExistsError(f"{key} already exists in memory")
            self._objects[key] = (bytes(data), time.time())

    def list(self, prefix: str, *, after: str | None = None) -> list[KeyInfo]:
        with self._lock:
            items = sorted(self._objects.items())
        return [KeyInfo(k, len(d), m, len(d)) for k, (d, m) in items
                if k.startswith(prefix) and (after is None or k > after)]

    def delete(self, key: str) -> bool:
        with self._lock:
            return self._objects.pop(check_key(key), None) is not None

    def open_writer(self, key: str) -> KeyWriter:
        """FileExistsError when ``key`` is there already (as a directory refuses it)."""
        with self._lock:
            if check_key(key) in self._objects:
                raise FileExistsError(f"{key} already exists in memory")
        return MemoryWriter(self, key)

    def describe(self) -> str:
        return f"memory:{id(self):x}"

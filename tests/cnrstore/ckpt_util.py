"""Shared helpers of the checkpoint-layer tests (C2): store factories and exact compares."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch

import cnrstore
import engine
from cnrstore.codec import native

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def make_store(kind: str, path, **opts) -> cnrstore.CheckpointStore:
    """A checkpoint store over the memory twin ("memory") or a real pack store ("pack")."""
    if kind == "memory":
        return cnrstore.CheckpointStore(engine.MemoryStore(), **opts)
    return cnrstore.open(path, **opts)


_SAME_SIZE_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order (NaN payloads and -0.0 included)."""
    t = t.detach().cpu()
    if t.dtype in _SAME_SIZE_INT:  # numpy has no bfloat16; same-size views keep the bits
        t = t.view(_SAME_SIZE_INT[t.dtype])
    return t.numpy().tobytes()


def assert_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    assert raw_bytes(got) == raw_bytes(want)


def random_table(gen: torch.Generator, rows: int, *tail: int, dtype=torch.float32):
    shape = (rows, *tail)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape,
                             generator=gen, dtype=torch.int64).to(dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def race_writers(docs: list[dict], go) -> list[tuple[str, str]]:
    """Two (or more) processes of tests/cnrstore/_s3_ckpt_worker.py, one per ``docs``
    entry, released together when ``go`` (a path) is created; their (stdout, stderr)."""
    import json
    import os
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "_s3_ckpt_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, json.dumps(doc)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for doc in docs]
    try:
        for p in procs:
            assert p.stdout is not None and p.stderr is not None
            assert p.stdout.readline().strip() == "ready", p.stderr.read()
        go.touch()
        return [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()


def checkpoint_machine(name: str):
    """(OPTS, CheckpointMachine) of test_state_machine.py, loaded by path as module
    ``name`` (tests/engine has a test_state_machine module of its own on sys.path), for the
    machines that run it on other stores."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(os.path.dirname(__file__), "test_state_machine.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OPTS, module.CheckpointMachine


@contextlib.contextmanager
def without_native_kernels():
    """The numpy/torch path of the codec, as where no kernel can be built."""
    real = native.kernel
    native.kernel = lambda **kw: None  # type: ignore[assignment]
    try:
        yield
    finally:
        native.kernel = real  # type: ignore[assignment]


def on_kernel_path(path: str, fallback: str):
    """The body of a module-scoped fixture that runs a module's tests on the compiled
    kernels and again on the fallback (``path == fallback``); skips the compiled run where
    no kernel can be built. Module scope, patched by hand: hypothesis refuses
    function-scoped fixtures."""
    if path == fallback:
        with without_native_kernels():
            yield path
        return
    if native.kernel(wait=True) is None:
        pytest.skip(f"no native kernel here: {native.status()['reason']}")
    yield path


def tracked_run(delta: float, n: int, *, seed: int, width: int
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(table, rows touched since the step before) of an ``n``-step run of a 200-row table
    whose hot rows change by ``delta`` again and again (small: an int8 row's codes often
    stay the same), the touched rows also holding some looked up and not changed."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(200, width, generator=g)
    hot = torch.randint(0, 200, (30,), generator=g)
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = [(t.clone(), None)]
    for _ in range(n - 1):
        changed = torch.cat([hot[torch.randint(0, 30, (10,), generator=g)],
                             torch.randint(0, 200, (4,), generator=g)])
        t[changed] += delta * torch.randn(len(changed), width, generator=g)
        out.append((t.clone(), torch.cat([changed, torch.randint(0, 200, (3,), generator=g)])))
    return out

"""A short, bounded run of the fuzz targets in fuzz/: the decoders of pack records,
trailers and commit documents raise only CorruptObject on malformed bytes, never another
exception, a hang or a big allocation.

Hypothesis feeds the targets' own ``check`` function arbitrary bytes and mutations of
valid encodings (the atheris seed corpus), under tracemalloc to catch allocations out of
proportion to the input. A few seconds of coverage-guided atheris in a subprocess checks
that the targets run as documented in fuzz/README.md.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "fuzz"))

import fuzz_commit  # noqa: E402
import fuzz_record  # noqa: E402
import fuzz_trailer  # noqa: E402

TARGETS = {"commit": fuzz_commit, "record": fuzz_record, "trailer": fuzz_trailer}
# The decoders may hold input-sized buffers a few times over, and zstd may expand up to
# the header's (bounded) raw_len; anything past this is a decompression bomb let through.
ALLOC_LIMIT = 32 << 20


@st.composite
def mutated(draw, seeds: list[bytes]) -> bytes:
    buf = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "splice-int"]))
        at = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and buf:
            buf[at] = draw(st.integers(0, 255))
        elif op == "cut":
            del buf[at : at + draw(st.integers(1, 64))]
        elif op == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "splice-int" and len(buf) >= at + 8:
            # Lengths and counts are the fields that allocate: try their extremes.
            value = draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1]))
            buf[at : at + 8] = value.to_bytes(8, "little")
    return bytes(buf)


def _run_bounded(target, data: bytes) -> None:
    tracemalloc.start()
    try:
        target.check(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOC_LIMIT + 8 * len(data), f"peak allocation {peak} for {len(data)} bytes"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_seeds_decode(name):
    # The seed corpus is valid: the targets must accept it without a CorruptObject path
    # being the only thing exercised.
    target = TARGETS[name]
    for seed in target.seeds():
        target.check(seed)


def test_commit_seeds_really_decode():
    from engine.format.commitdoc import decode_commit

    for seed in fuzz_commit.seeds():
        buf = fuzz_commit.reseal(seed[1:]) if seed[:1] == b"\x01" else seed
        assert decode_commit(buf, fuzz_commit.KEY).seq == 3


def test_record_seeds_really_decode():
    from engine.format.records import decode_record

    for seed in fuzz_record.seeds():
        buf = fuzz_record.reseal(seed[1:]) if seed[:1] == b"\x01" else seed
        rec = decode_record(buf, 0)
        assert rec.header.length == len(buf)


_FUZZ = settings(
    max_examples=300,
    deadline=2000,  # a hang shows up as a deadline miss
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)


@pytest.mark.parametrize("name", sorted(TARGETS))
@_FUZZ
@given(data=st.data())
def test_target_raises_only_corrupt_object(name, data):
    target = TARGETS[name]
    buf = data.draw(st.one_of(st.binary(max_size=512), mutated(target.seeds())))
    _run_bounded(target, buf)


def _rss_limit_mb(budget: int = 1024) -> int:
    """libFuzzer's limit reads the child's peak RSS, which Linux carries over from this
    process across fork and exec: after a memory-heavy test in the same run, every fuzz
    run 'ran out of memory' before its first input. Allow the budget above that floor."""
    import resource

    return budget + resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


@pytest.mark.parametrize(
    "name, runs",
    [
        *((n, 4000) for n in sorted(TARGETS)),
        *(pytest.param(n, 300_000, marks=pytest.mark.slow) for n in sorted(TARGETS)),
    ],
)
def test_atheris_run(name, runs, tmp_path):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k, seed in enumerate(TARGETS[name].seeds()):
        (corpus / f"seed{k}").write_bytes(seed)
    cmd = [
        sys.executable,
        str(ROOT / "fuzz" / f"fuzz_{name}.py"),
        f"-runs={runs}",
        "-max_len=4096",
        f"-rss_limit_mb={_rss_limit_mb()}",
        "-timeout=5",
        "-seed=1",
        str(corpus),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Done {runs} runs" in proc.stderr

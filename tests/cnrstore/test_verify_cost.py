"""A deep verify reads each block object once, however many steps share its patch chain
(issue 27, "How cost grows"). Each step's patch sits on the previous step's, so resolving
every step's chain from the full block up read sum(depth + 1) objects: with 40 steps of a
one-block table, 861 block reads for 41 objects, and verify time grew with steps x table
size (benches/bench_scaling.py: 0.15 s at 1 step, 5.8 s at 30, for a 64 MiB table)."""

from __future__ import annotations

import torch
from ckpt_util import random_table

import cnrstore
from cnrstore.format.blocks import KIND_BLOCK_FULL, KIND_BLOCK_PATCH
from cnrstore.format.load import list_steps, load_manifest


class CountingReads:
    """The real store, with every ``get`` of a block object counted by id."""

    def __init__(self, objects) -> None:
        self._objects = objects
        self.block_reads: list[bytes] = []

    def get(self, oid: bytes):
        obj = self._objects.get(oid)
        if obj.kind in (KIND_BLOCK_FULL, KIND_BLOCK_PATCH):
            self.block_reads.append(oid)
        return obj

    def __getattr__(self, name: str):
        return getattr(self._objects, name)


def _chain_store(path, steps: int):
    store = cnrstore.open(path, block_rows=64, fanout=4, max_chain=64)
    t = random_table(torch.Generator().manual_seed(0), 64, 8)
    store.put_tables(0, {"t": t})
    for step in range(1, steps + 1):
        t[step % 64] += 1.0  # one row per step: a patch on the previous step's block
        store.put_tables(step, {"t": t})
    return store


def test_deep_verify_reads_each_block_object_once(tmp_path):
    from cnrstore.core.verify import verify_objects

    store = _chain_store(tmp_path / "s", 40)
    try:
        objects = store.objects
        tops = {load_manifest(objects, s).tables["t"].block_ids[0] for s in list_steps(objects)}
        assert len(tops) == 41  # one chain: the full block and 40 patches
        counted = CountingReads(objects)
        result = verify_objects(counted, deep=True)
        assert result.ok, result.problems
        assert result.blocks_decoded == 41
        assert sorted(counted.block_reads) == sorted(tops)  # each exactly once
    finally:
        store.close()


def test_a_bad_object_in_a_shared_chain_is_reported_for_every_step_above_it(tmp_path):
    from cnrstore.core import verify as verify_mod

    store = _chain_store(tmp_path / "s", 6)
    try:
        objects = store.objects
        tops = [load_manifest(objects, s).tables["t"].block_ids[0] for s in range(7)]
        bad = tops[3]

        class Damaged(CountingReads):
            def get(self, oid):
                if oid == bad:
                    from cnrstore.errors import ManifestError
                    raise ManifestError("crafted damage", oid=oid)
                return super().get(oid)

        result = verify_mod.verify_objects(Damaged(objects), deep=True)
        assert {p.step for p in result.problems} == {3, 4, 5, 6}
        assert all("crafted damage" in p.message for p in result.problems)
    finally:
        store.close()

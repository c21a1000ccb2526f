"""get_tables(out=) / load_state decode all their tables in one pool pass
(restore.read_many_into): the same bits as fresh reads, for every scheme, patch chains,
zero-row and non-contiguous destinations, and progress that adds up to the bytes."""

from __future__ import annotations

import torch
from ckpt_util import assert_identical

import cnrstore
import engine


def test_one_pass_into_many_tables_gives_the_fresh_reads_bits():
    g = torch.Generator().manual_seed(5)
    tables = {"e": torch.randn(700, 8, generator=g), "q8": torch.randn(500, 16, generator=g),
              "q4": torch.randn(300, 8, generator=g), "ids": torch.arange(90),
              "none": torch.zeros(0, 4), "one": torch.tensor([2.5])}
    quant = {"q8": "int8", "q4": "int4"}
    with cnrstore.CheckpointStore(engine.MemoryStore(), block_rows=64, decode_threads=2,
                                  progress_min_bytes=0) as s:
        s.put_tables(1, tables, quant=quant)
        for t in ("e", "q8", "q4"):
            tables[t][::7] += 1.0
        s.put_tables(2, tables, quant=quant)  # patch chains under every block
        want = s.get_tables(2)
        out = {n: torch.full_like(t, -7) for n, t in tables.items()}
        wide = torch.full((700, 16), -7.0)
        out["e"] = wide[:, ::2]  # not contiguous: decoded per block and copied
        seen: list[tuple[int, int]] = []
        s.get_tables(2, out=out, progress=lambda d, total: seen.append((d, total)))
    for n in tables:
        assert_identical(out[n], want[n])
    assert torch.all(wide[:, 1::2] == -7.0)  # nothing beside the destination written
    total = sum(t.nbytes for t in out.values())
    assert seen and seen[-1] == (total, total)

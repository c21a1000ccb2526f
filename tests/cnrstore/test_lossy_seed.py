"""A lossy table restored and put again unchanged writes no rows, even where re-encoding
the restored values would not reproduce the stored codes (fp16/bf16 tables under intN)."""

import pytest
import torch

import cnrstore


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_restored_lossy_table_put_again_writes_no_rows(tmp_path, dtype, scheme):
    g = torch.Generator().manual_seed(1)
    table = (torch.randn(2000, 24, generator=g) * 3).to(dtype)
    with cnrstore.open(tmp_path / "s", block_rows=256) as s:
        s.put_tables(0, {"t": table}, quant=scheme)
    with cnrstore.open(tmp_path / "s", block_rows=256) as s:  # a restarted job
        restored = s.get_tables(0)["t"]
        info = s.put_tables(1, {"t": restored}, quant=scheme)
        assert info.rows_changed["t"] == 0
        restored[7] += 1  # one row trained after the restore
        info = s.put_tables(2, {"t": restored}, quant=scheme)
        assert info.rows_changed["t"] == 1
        assert torch.equal(s.get_tables(1)["t"], s.get_tables(0)["t"])

"""Tables shrinking to zero rows, also against a diff base seeded from the store."""

import torch

import cnrstore


def test_shrink_to_zero_rows_after_reopen(tmp_path):
    path = tmp_path / "s"
    with cnrstore.open(path, block_rows=4) as s:
        s.put_tables(0, {"a": torch.arange(24.0).reshape(6, 4)})
    with cnrstore.open(path, block_rows=4) as s:  # fresh handle: base seeded from step 0
        s.put_tables(1, {"a": torch.empty(0, 4)})
        s.put_tables(2, {"a": torch.ones(3, 4)})
        assert s.get_tables(1)["a"].shape == (0, 4)
        assert torch.equal(s.get_tables(2)["a"], torch.ones(3, 4))
        assert torch.equal(s.get_tables(0)["a"], torch.arange(24.0).reshape(6, 4))


def test_zero_row_tables_fingerprint_and_encode():
    from cnrstore.codec.fingerprint import row_fingerprints
    from cnrstore.codec.quantize import encode_rows

    assert row_fingerprints(torch.empty(0, 3, 2)).shape == (0,)
    assert encode_rows(torch.empty(0, 4), "exact").shape == (0, 16)

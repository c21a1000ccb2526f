"""put_state/load_state/get_state on many ranks with DTensor leaves (row-sharded and
replicated), plain tensors and Python values: the same table ids as a single-process
put_state of the assembled state, and the values restored in place on every rank."""

from __future__ import annotations

import torch
from dist_util import BLOCK_ROWS, FANOUT, Failed, run
from dist_workers import dtensor_state, state_of

import cnrstore


def test_dtensor_state_round_trip(tmp_path):
    with cnrstore.open(tmp_path / "o", block_rows=BLOCK_ROWS, fanout=FANOUT) as o:
        want_ids = [o.put_state(s, state_of(s), quant={"model/*": "int8"}).tables
                    for s in (1, 2)]
        want = o.get_state(2)
    res = run(2, dtensor_state, str(tmp_path / "s"))
    for rank, r in enumerate(res):
        assert not isinstance(r, Failed), r.trace
        ids, epoch, emb, rep, bias, whole = r
        assert ids == want_ids
        assert epoch == 2 and whole["epoch"] == 2
        wm = want["model"]
        assert torch.equal(emb, wm["emb.weight"][45 * rank:45 * (rank + 1)])
        assert torch.equal(rep, wm["rep.weight"]) and torch.equal(bias, wm["bias"])
        for k in wm:
            assert torch.equal(whole["model"][k], wm[k]), k
        assert torch.equal(whole["optim"]["state"][0]["step"], torch.tensor(2.0))


def test_a_malformed_state_on_one_rank_fails_on_every_rank(tmp_path):
    from dist_workers import bad_state

    res = run(2, bad_state, str(tmp_path / "s"))
    for r in res:
        assert not isinstance(r, Failed), r.trace
    assert res[0] == res[1] and res[0][2] == [], res
    assert res[0][0] is not None and res[0][1] == "InvalidType", res


def test_load_state_reads_sharded_leaves_in_windows_on_every_rank(tmp_path):
    # Row pieces in contiguous CPU memory (TorchRec's tables and optimizer states) are
    # read in one pass of windows, each file forwards, on the coordinator and on the rank
    # reading through its located view: no read-ahead hints. Filled one table at a time,
    # each block was located alone and hinted (7 hints a rank before). The blocks a rank
    # reads for another (the cut at row 90: rank 0 holds 26 rows of block 2, rank 1 6)
    # are a window of their own, read first (distributed/boundary.py).
    from dist_workers import load_state_reads

    res = run(2, load_state_reads, str(tmp_path / "s"))
    for r, got in enumerate(res):
        assert not isinstance(got, Failed), got.trace
        counts, ok = got
        assert ok
        assert counts.get("hint", 0) == 0, counts
        # all 6-9 blocks: one 32 MiB window, and rank 0's two boundary blocks one more
        assert counts.get("window", 0) == (2 if r == 0 else 1), (r, counts)

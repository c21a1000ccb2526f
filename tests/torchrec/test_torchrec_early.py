"""The first blocks of a TorchRec restore, hinted before the load's structure and request
rounds (cnrstore/core/early.py, cnrstore/distributed/torchrec.py): each rank hints,
through the real hint path, exactly the blocks overlapping the rows it holds under the
new plan, in its state's order, once each; and the restore reads the same rows."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import torch  # noqa: E402
import trmodels  # noqa: E402
import trspawn  # noqa: E402

TIMEOUT = 240
SAVE = {"t0": "tw:1", "t1": "rw", "t2": "twrw"}
LOAD3 = {"t0": "twrw", "t1": "tw:2", "t2": "rw"}


def _rows(state) -> dict:
    """path -> [(first row, local rows)] of this rank's tensor leaves."""
    from cnrstore.distributed.leaves import shard_leaf
    from cnrstore.distributed.torchrec import _leaf_paths

    out = {}
    for path, leaf in _leaf_paths(state):
        shards = shard_leaf(leaf)
        if shards is not None:
            out[path] = [(s.row_offset, s.local.clone()) for s in shards]
        elif isinstance(leaf, torch.Tensor):
            out[path] = [(0, leaf.detach().clone())]
    return out


def _save_worker(rank, world, path):
    import torch.distributed as dist

    import cnrstore
    from cnrstore.distributed import torchrec as ctr

    m = trmodels.dmp("ebc", SAVE, world, seed=1)
    trmodels.train_step(m, "ebc", trmodels.batch("ebc", 10, rank=rank, world=world))
    with cnrstore.open(path, group=dist.group.WORLD, block_rows=4) as store:
        state = ctr.state_dict(m)
        store.put_state(1, state)
    return _rows(state)


def _load_worker(rank, world, path):
    import torch.distributed as dist

    import cnrstore
    from cnrstore.core import early
    from cnrstore.distributed import torchrec as ctr
    from cnrstore.format.load import load_step, load_table_manifest
    from engine import RecordLocation

    m = trmodels.dmp("ebc", LOAD3, world, seed=2)  # other initial values
    hinted: list = []
    real = early.hint

    def spy(source, chains):  # records what the load hints, and hints it
        hinted.append(chains)
        t = real(source, chains)
        if t is not None:
            t.join(30)
        return t

    early.hint = spy
    try:
        with cnrstore.open(path, group=dist.group.WORLD) as store:
            ctr.load(store, 1, m)

            def blocks(st):
                _, node = load_step(st.objects, 1)
                return {n: (tm.node.block_rows, tm.block_ids) for n, tm in (
                    (n, load_table_manifest(st.objects, t))
                    for n, t in zip(node.tables, node.table_ids))}

            stored = store.coordinated("test: blocks", blocks)
    finally:
        early.hint = real
    loaded = _rows(ctr.state_dict(m))
    # the blocks overlapping each of this rank's row ranges, in its state's order, once
    want, seen = [], set()
    for path, pieces in _rows({"model": m.state_dict(),
                               "optim": m.fused_optimizer.state_dict()}).items():
        block_rows, ids = stored[path]
        for lo, t in pieces:
            if not t.shape[0]:
                continue
            for b in range(lo // block_rows, -(-(lo + int(t.shape[0])) // block_rows)):
                if (path, b) not in seen:
                    seen.add((path, b))
                    want.append(ids[b])
    assert len(hinted) == 1, len(hinted)
    got = [RecordLocation.from_wire(chain[0]).oid for chain in hinted[0]]
    assert got == want
    return loaded, len(want)


def test_each_rank_hints_the_blocks_of_its_rows_before_it_reads(tmp_path):
    path = str(tmp_path / "store")
    saved = trspawn.run(_save_worker, 2, path, timeout=TIMEOUT)
    got = trspawn.run(_load_worker, 3, path, timeout=TIMEOUT)
    assert all(n > 0 for _, n in got)  # every rank holds rows under LOAD3
    whole = {}
    for rank_rows in saved:
        for p, pieces in rank_rows.items():
            for lo, t in pieces:
                if t.shape[0]:
                    whole.setdefault(p, {})[lo] = t

    def table(p):
        return torch.cat([t for _, t in sorted(whole[p].items())])

    for loaded, _ in got:
        for p, pieces in loaded.items():
            for lo, t in pieces:
                assert torch.equal(t, table(p)[lo:lo + t.shape[0]]), p

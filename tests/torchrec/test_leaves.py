"""shard_leaf/fill_leaf on real ShardedTensors and DTensors in spawned gloo ranks: the Shards
of all ranks tile each table with the right rows, and a fill lands in the leaf's storage."""

from __future__ import annotations

import warnings

import pytest
import torch
import trspawn
from trcheck import check_tiling, describe, table

from cnrstore.distributed.leaves import fill_leaf, shard_leaf
from cnrstore.distributed.shard import Shard
from cnrstore.errors import InvalidInput

TIMEOUT = 90


def _sharded_tensor_worker(rank, world):
    from torch.distributed._shard.sharded_tensor import Shard as StShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from cnrstore.distributed.statestore import _sharded
    from cnrstore.distributed.torchrec import _rows_of

    def make(name, gshape, pieces):  # pieces: (row offset, rows, owner rank)
        g = table(name, gshape)
        local = [StShard.from_tensor_and_offsets(g[o:o + n].clone(), [o] + [0] * (len(gshape) - 1),
                                                 rank) for o, n, r in pieces if r == rank]
        return ShardedTensor._init_from_local_shards(local, list(gshape))

    out = {}
    # uneven row-wise; two pieces on rank 0 and none on rank 1 for "split"; a 1-D state
    cases = {"rw": ((13, 3), [(0, 7, 0), (7, 6, 1)]),
             "split": ((10, 2), [(0, 4, 0), (4, 6, 0)] if world == 2 else []),
             "mom": ((9,), [(0, 5, 1), (5, 4, 0)])}
    for name, (gshape, pieces) in cases.items():
        st = make(name, gshape, pieces)
        shards = shard_leaf(st)
        assert all(isinstance(s, Shard) for s in shards)
        out[name] = describe(shards)
        # fill with a different table's values (of the same shape): lands in the storage
        other = table("x" + name, gshape)
        fill_leaf(st, lambda lo, hi, o=other: o[lo:hi])
        for s in st.local_shards():
            off = s.metadata.shard_offsets[0]
            torch.testing.assert_close(s.tensor, other[off:off + s.tensor.shape[0]])
        # put_state's walk and the tracker's row count read a ShardedTensor's shape and
        # dtype on the caller's thread at every checkpoint: not through its .shape/.dtype,
        # which dispatch through __torch_function__ and warn (~1 ms a leaf, issue 26)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            plain, found = _sharded({"t": st}, shard_leaf)
            assert _rows_of(st) == gshape[0]
        assert tuple(plain["t"].shape) == gshape and plain["t"].dtype == other.dtype
        assert found == {"t": st}
    cw = ShardedTensor._init_from_local_shards(
        [StShard.from_tensor_and_offsets(torch.zeros(4, 2), [0, 2 * rank], rank)], [4, 4])
    with pytest.raises(InvalidInput, match="columns"):
        shard_leaf(cw)
    assert shard_leaf(torch.zeros(3, 2)) is None
    return out


def _both_worker(rank, world, path):
    return _sharded_tensor_worker(rank, world), _dtensor_worker(rank, world, path)


def test_sharded_tensor_and_dtensor_rows_tile_and_fill(tmp_path):
    both = trspawn.run(_both_worker, 2, str(tmp_path / "s"), timeout=TIMEOUT)  # one spawn
    _check_dtensor([d for _, d in both])
    per_rank = [s for s, _ in both]
    check_tiling([r["rw"] for r in per_rank], (13, 3), "rw")
    check_tiling([r["mom"] for r in per_rank], (9,), "mom")
    check_tiling([r["split"] for r in per_rank], (10, 2), "split")
    # rank 1 holds no row of "split": one zero-row Shard names the table there
    assert [(o, n, s) for o, n, s, _ in per_rank[1]["split"]] == [(0, 10, (0, 2))]
    assert [o for o, *_ in per_rank[0]["split"]] == [0, 4]


def _dtensor_worker(rank, world, path=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as PShard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, gshape, placement in [("row", (11, 3), PShard(0)), ("rep", (5, 2), Replicate()),
                                    ("vec", (7,), PShard(0))]:
        dt = distribute_tensor(table(name, gshape), mesh, [placement])
        out[name] = describe(shard_leaf(dt))
        other = table("x" + name, gshape)
        fill_leaf(dt, lambda lo, hi, o=other: o[lo:hi])
        # every replica and every shard is filled: the whole tensor reads back as `other`
        torch.testing.assert_close(dt.full_tensor(), other)
    col = distribute_tensor(table("col", (5, 2 * world)), mesh, [PShard(1)])
    with pytest.raises(InvalidInput, match="columns"):
        shard_leaf(col)
    if path is not None:  # put_state joins its column pieces; load_state fills them
        import torch.distributed as dist

        import cnrstore

        with cnrstore.open(path, group=dist.group.WORLD) as store:
            store.put_state(1, {"col": col})
            back = distribute_tensor(torch.zeros(5, 2 * world), mesh, [PShard(1)])
            store.load_state(1, {"col": back})
            whole = store.get_state(1)["col"]
        torch.testing.assert_close(back.full_tensor(), table("col", (5, 2 * world)))
        torch.testing.assert_close(whole, table("col", (5, 2 * world)))
    part = DTensor.from_local(torch.zeros(4, 4), mesh, [Partial()])
    with pytest.raises(InvalidInput, match="Partial"):
        shard_leaf(part)
    return out


@pytest.mark.slow
def test_dtensor_rows_tile_and_fill_at_three_ranks():
    _check_dtensor(trspawn.run(_dtensor_worker, 3, timeout=TIMEOUT))


def _check_dtensor(per_rank):
    check_tiling([r["row"] for r in per_rank], (11, 3), "row")
    check_tiling([r["vec"] for r in per_rank], (7,), "vec")
    # a replicated DTensor is stored once: rank 0 names all rows, the others none
    check_tiling([r["rep"] for r in per_rank], (5, 2), "rep")
    assert all(s[2][0] == 0 for r in per_rank[1:] for s in r["rep"])


def test_plain_tensor_and_shard_leaves_in_one_process():
    assert shard_leaf(torch.zeros(2, 2)) is None
    assert shard_leaf({"a": 1}) is None
    t = torch.zeros(4, 2)
    fill_leaf(t, lambda lo, hi: table("p", (4, 2))[lo:hi])
    torch.testing.assert_close(t, table("p", (4, 2)))
    placeholder = Shard(torch.empty(0, 3), row_offset=0, rows=9)
    got = shard_leaf(placeholder)
    assert len(got) == 1 and got[0] is placeholder
    fill_leaf(placeholder, lambda lo, hi: pytest.fail("nothing to read"))
    with pytest.raises(InvalidInput, match="nothing was written"):
        fill_leaf(torch.zeros(4, 2), lambda lo, hi: torch.zeros(hi - lo, 3))

"""Loads of part of a state on a DistributedStore (issue 25, part 3): get_state and
load_state with names= on 2 ranks read the picked tables' objects and nothing else,
counted per rank (the coordinator's pack store reads, the other rank's located view)."""

from __future__ import annotations

import torch
from dist_util import Failed, run
from partial_workers import partial, state_of

import cnrstore
from cnrstore.format.load import load_step


def _closures(path) -> dict[str, set[bytes]]:
    with cnrstore.open(path) as s:
        objects = s.objects
        _, node = load_step(objects, 1)
        out = {}
        for name, tid in zip(node.tables, node.table_ids):
            seen, todo = set(), [tid]
            while todo:
                o = todo.pop()
                if o not in seen:
                    seen.add(o)
                    todo.extend(objects.info(o).refs)
            out[name] = seen
        return out


def _only(read: set[bytes], closures: dict, picked: set[str], served: frozenset[str] = frozenset()
          ) -> None:
    """``read`` lies under ``picked`` tables, or ``served`` ones (the coordinator reads the
    manifests of the tables the other ranks picked, to send them)."""
    mine = set().union(*(closures[n] for n in picked | served))
    others = set().union(*(c for n, c in closures.items() if n not in picked | served)) - mine
    assert not read & others, sorted(n for n, c in closures.items() if c & read - mine)
    assert read & mine  # something of the picked tables was read here


def test_partial_state_loads_on_two_ranks(tmp_path):
    res = run(2, partial, str(tmp_path / "s"))
    for r in res:
        assert not isinstance(r, Failed), r.trace
    closures = _closures(tmp_path / "s")
    want = state_of(1)
    part0, part1 = res[0][0], res[1][0]
    assert part0 == {"model": {"emb.weight": part0["model"]["emb.weight"]}, "epoch": 1}
    assert torch.equal(part0["model"]["emb.weight"], want["model"]["emb.weight"])
    assert list(part1) == ["model"] and list(part1["model"]) == ["big.weight"]
    assert torch.equal(part1["model"]["big.weight"], want["model"]["big.weight"])
    _only(res[0][1], closures, {"model/emb.weight"}, served={"model/big.weight"})
    _only(res[1][1], closures, {"model/big.weight"})
    for rank, r in enumerate(res):
        _, _, read_load, emb, optim, sum_filled, err = r
        _only(read_load, closures, {"model/emb.weight"})
        assert torch.equal(emb, want["model"]["emb.weight"][100 * rank:100 * (rank + 1)])
        assert optim["param_groups"] == [{"lr": 0.5}] and not sum_filled
        assert err == "InvalidInput"  # rank 1's pattern matched nothing: every rank raises

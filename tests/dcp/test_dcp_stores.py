"""A store that DCP writers and readers open from a path stays open for the next save or
load of this process (cnrstore/dcp/stores.py), and is opened afresh whenever anything
else changed it: another handle, another process, a directory made anew."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cnrstore
from cnrstore.dcp import StorageReader, StorageWriter, close_stores, stores

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(3000, 16, generator=g), "bias": torch.randn(16, generator=g)}


def _kept(path) -> list:
    real = os.path.realpath(path)
    return [e.store for k, e in stores._entries.items() if k[0] == real]


def _load(path, step, like) -> dict:
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(target, storage_reader=StorageReader(path, step=step))
    return target


def test_a_path_keeps_its_store_between_saves_and_loads(tmp_path):
    path = str(tmp_path / "ckpt")
    s = _state(0)
    dcp.save(s, storage_writer=StorageWriter(path, step=1, block_rows=512))
    (first,) = _kept(path)
    s["emb"][[3, 2000]] += 1.0
    w = StorageWriter(path, step=2, block_rows=512)
    dcp.save(s, storage_writer=w)
    assert _kept(path) == [first]  # the same handle: its diff bases are in memory
    assert w.info.rows_changed == {"emb": 2, "bias": 0}
    assert w.info.bytes_written < 3 * 512 * 16 * 4
    got = _load(path, 2, s)
    assert all(torch.equal(got[k], s[k]) for k in s)
    with cnrstore.open(path) as plain:   # the store is an ordinary store meanwhile
        assert plain.steps() == [1, 2]
    close_stores()
    assert _kept(path) == []
    with pytest.raises(cnrstore.CheckpointError):
        first.steps()  # closed


def test_another_handle_changing_the_store_makes_the_next_save_open_it_again(tmp_path):
    path, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    s = _state(1)
    dcp.save(s, storage_writer=StorageWriter(path, step=1, block_rows=512))
    (first,) = _kept(path)
    with cnrstore.open(path) as plain:  # another writer: a step in, the first one out
        s2 = _state(2)
        plain.put_tables(2, {"emb": s2["emb"], "bias": s2["bias"]})
        put2 = {k: v.clone() for k, v in s2.items()}
        plain.delete_step(1)
        plain.gc()
    s2["emb"][7] = 0.5
    w = StorageWriter(path, step=3, block_rows=512)
    dcp.save(s2, storage_writer=w)
    (again,) = _kept(path)
    assert again is not first
    with cnrstore.open(other, block_rows=512) as ref:  # the blocks of the same history
        ref.put_tables(2, put2)
        assert ref.put_tables(3, {"emb": s2["emb"], "bias": s2["bias"]}).tables == w.info.tables
    assert w.info.rows_changed["emb"] == 1  # diffed against step 2, seeded afresh
    got = _load(path, 3, s2)
    assert all(torch.equal(got[k], s2[k]) for k in s2)
    with cnrstore.open(path) as plain:
        assert plain.verify().ok


def test_a_directory_removed_and_made_again_gets_the_next_save(tmp_path):
    """The kept handle's index is the removed directory's: a save through it would land
    in deleted files and the new directory would stay empty."""
    path = str(tmp_path / "ckpt")
    s = _state(3)
    dcp.save(s, storage_writer=StorageWriter(path, step=1))
    (first,) = _kept(path)
    shutil.rmtree(path)
    s["emb"] += 1.0
    dcp.save(s, storage_writer=StorageWriter(path, step=1))
    assert _kept(path)[0] is not first
    with cnrstore.open(path) as plain:
        assert plain.steps() == [1]
        assert torch.equal(plain.get_tables(1, names=["emb"])["emb"], s["emb"])


_OTHER = textwrap.dedent("""
    import sys, time, warnings
    warnings.simplefilter("ignore")
    import cnrstore, torch, torch.distributed.checkpoint as dcp
    from cnrstore.dcp import StorageReader
    path, stop = sys.argv[1], sys.argv[2]
    import os
    rounds = 0
    while not os.path.exists(stop) or rounds < 3:
        with cnrstore.open(path) as s:
            steps = s.steps()
            if len(steps) > 2:
                s.delete_steps(steps[:-2])
            s.gc()
            assert s.verify().ok
        if steps:
            t = {"emb": torch.zeros(3000, 16), "bias": torch.zeros(16)}
            dcp.load(t, storage_reader=StorageReader(path))   # the latest, kept open
        rounds += 1
    print(rounds)
""")


def test_two_processes_racing_one_saving_the_other_deleting_and_reading(tmp_path):
    path, stop = str(tmp_path / "ckpt"), str(tmp_path / "stop")
    s = _state(4)
    dcp.save(s, storage_writer=StorageWriter(path, step=0))
    proc = subprocess.Popen([sys.executable, "-c", _OTHER, path, stop],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    saved = {}
    try:
        for step in range(1, 9):
            s["emb"][step * 100:(step * 100) + 5] += 1.0
            dcp.save(s, storage_writer=StorageWriter(path, step=step))
            saved[step] = {k: v.clone() for k, v in s.items()}
    finally:
        open(stop, "w").close()
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert int(out.split()[-1]) >= 3
    with cnrstore.open(path) as plain:
        assert plain.verify().ok
        kept = plain.steps()
    assert kept[-1] == 8
    for step in kept:
        if step:
            got = _load(path, step, s)
            assert all(torch.equal(got[k], saved[step][k]) for k in s), step

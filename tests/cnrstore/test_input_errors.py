"""Bad arguments that once escaped as Python's or torch's own errors, or failed only in the
background writer (issue 8, "Errors that escape or lie"): each is refused up front as a
CheckpointError (InvalidInput) with a clear message, nothing is written, and the handle
keeps its diff bases."""

from __future__ import annotations

import pytest
import torch
from ckpt_util import assert_identical, make_store, random_table

import cnrstore


@pytest.fixture(params=["memory", "pack"])
def store(request, tmp_path):
    s = make_store(request.param, tmp_path / "ckpt", block_rows=8, fanout=4)
    yield s
    s.close()


def _put_base(store):
    g = torch.Generator().manual_seed(0)
    t = random_table(g, 32, 4)
    store.put_tables(0, {"t": t})
    return t


@pytest.mark.parametrize("step, tables_of, words", [
    (2**64, lambda t: {"t": t}, ["step", "2**64"]),
    (2**64 + 5, lambda t: {"t": t}, ["step"]),
    (10**19 * 5, lambda t: {"t": t}, ["step"]),
    (1, lambda t: {"t": t, "bad\udc80name": t}, ["table name", "UTF-8"]),
    (1, lambda t: {"t": t, "m": torch.empty(4, 2, device="meta")}, ["'m'", "meta"]),
])
def test_put_refused_up_front_keeps_store_and_diff_base(store, step, tables_of, words):
    t = _put_base(store)
    with pytest.raises(cnrstore.InvalidInput) as err:
        store.put_tables(step, tables_of(t))
    msg = str(err.value)
    assert all(w in msg for w in words), msg
    assert store.steps() == [0]
    # The handle still diffs against step 0: one changed row writes one patch.
    t[3] += 1
    info = store.put_tables(1, {"t": t})
    assert info.rows_changed == {"t": 1} and info.rows_written == {"t": 1}
    assert_identical(store.get_tables(1)["t"], t)


def test_largest_step_below_2_64_works(store):
    t = _put_base(store)
    store.put_tables(2**64 - 1, {"t": t})
    assert store.steps() == [0, 2**64 - 1]
    assert_identical(store.get_tables(2**64 - 1)["t"], t)


@pytest.mark.parametrize("sel, words", [
    (slice(0, 10, 0), ["rows['t']", "step"]),
    (slice(0.5, 3), ["rows['t']", "int"]),
    (slice("a", None), ["rows['t']", "int"]),
])
def test_bad_row_slices_are_invalid_input(store, sel, words):
    _put_base(store)
    with pytest.raises(cnrstore.InvalidInput) as err:
        store.get_tables(0, rows={"t": sel})
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_invalid_input(store):
    _put_base(store)
    with pytest.raises(cnrstore.InvalidInput) as err:
        store.get_tables(0, device="cuda")
    assert "cuda" in str(err.value)


def test_meta_device_is_invalid_input(store):
    _put_base(store)
    with pytest.raises(cnrstore.InvalidInput) as err:
        store.get_tables(0, device="meta")
    assert "meta" in str(err.value)


def test_numpy_int_slice_bounds_still_work(store):
    import numpy as np

    t = _put_base(store)
    got = store.get_tables(0, rows={"t": slice(np.int64(2), np.int32(9), np.int64(3))})["t"]
    assert_identical(got, t[2:9:3])

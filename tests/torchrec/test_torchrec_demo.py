"""cnrstore demo --torchrec: TorchRec's DLRM killed at 2 ranks and resumed at 3 under another
plan ends where an uninterrupted run ends; at the same world size, bit for bit."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")


def test_cli_refuses_a_kill_after_the_last_step(capsys):
    from cnrstore.cli.app import main

    assert main(["demo", "--torchrec", "--steps", "5", "--fail-at", "9"]) == 2
    assert "--fail-at" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [(2, 3), (2, 2)])
def test_resumed_at_another_world_size_ends_like_an_uninterrupted_run(tmp_path, worlds):
    from cnrstore.demo import torchrec_demo

    r = torchrec_demo.run(steps=30, every=10, fail_at=25, world=worlds[0],
                          resume_world=worlds[1], seed=3, root=str(tmp_path), quiet=True)
    assert r["resumed_from"] == 20 and r["checkpoints"] >= 3
    assert r["bytes_later_mean"] < r["bytes_first"]  # incremental checkpoints
    if worlds[0] == worlds[1]:
        assert r["loss_diff"] == 0.0 and r["max_table_diff"] == 0.0
    else:  # only the order of floating-point sums differs between world sizes
        assert r["loss_diff"] < 1e-5 and r["max_table_diff"] < 1e-4

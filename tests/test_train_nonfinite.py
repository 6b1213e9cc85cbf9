"""A non-finite loss stops the run with a clear message and keeps the last good checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from test_train_support import losses, one_thread, tiny_config, tiny_data, weights  # noqa: F401
from tngram.common import TngramError
from tngram.model.gpt import GPT
from tngram.train import checkpoint as ckpt
from tngram.train.loop import train


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_data, tmp_path, monkeypatch):
    """The training loss becomes NaN at step 5 (forward patched); checkpoints at 2 and 4 stay."""
    real_forward = GPT.forward
    calls = {"train": 0}

    def forward(self, ids, targets=None, reduction="mean"):
        out = real_forward(self, ids, targets, reduction)
        if targets is not None and reduction == "mean":
            calls["train"] += 1
            if calls["train"] > 8:          # 2 micro-steps per step: calls 9-10 are step 5
                return out * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", forward)
    cfg = tiny_config(tiny_data, extra=["run.checkpoint_every=2", "run.val_every=0"])
    with pytest.raises(TngramError, match=r"non-finite training loss \(nan\) at step 5.*step_000004"):
        train(cfg, tmp_path)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)] == [2, 4]
    assert not (tmp_path / "summary.json").exists()
    assert all(torch.isfinite(t).all() for t in weights(tmp_path, 4).values())
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in losses(tmp_path).values())


def test_absurd_lr_via_cli_fails_cleanly(tiny_data, tmp_path, capsys):
    """scalar_lr=1e30 makes the loss NaN at step 2 (measured); exit code 2, one clear message."""
    from test_train_support import cli_args
    from tngram.cli import main
    rc = main(["train", *cli_args(tiny_data, "mini-tngram", tmp_path / "run", ["optim.scalar_lr=1e30"])])
    err = capsys.readouterr().err
    assert rc == 2
    assert "non-finite training loss" in err and "Lower the learning rates" in err
    assert not (tmp_path / "run" / "summary.json").exists()

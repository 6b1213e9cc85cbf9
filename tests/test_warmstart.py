"""run.init_from + optim.trainable=memory: a memory added to a trained raw model, backbone frozen."""

from __future__ import annotations

import pytest
import torch

from test_train_support import one_thread, tiny_config, tiny_data, weights  # noqa: F401
from tngram.common import TngramError
from research.experiments.memory_on_trained import recovered_fraction
from tngram.train.loop import train
from tngram.train.warmstart import is_memory_param


def test_memory_only_training_keeps_the_backbone_bit_identical(tiny_data, tmp_path):
    raw = train(tiny_config(tiny_data, "mini-raw", ["schedule.steps=4", "run.val_every=0"]),
                tmp_path / "raw")
    raw_w = weights(tmp_path / "raw")
    cfg = tiny_config(tiny_data, "mini-tngram", ["schedule.steps=4", "run.val_every=0",
                                                 f"run.init_from={tmp_path / 'raw'}",
                                                 "optim.trainable=memory"])
    out = train(cfg, tmp_path / "frozen")
    new_w = weights(tmp_path / "frozen")
    mem_keys = [k for k in new_w if is_memory_param(k)]
    assert mem_keys and set(new_w) - set(mem_keys) == set(raw_w)
    for k, v in raw_w.items():                        # every backbone tensor untouched
        assert torch.equal(new_w[k], v), k
    # the memory was trained: its value projection left its zero initialisation
    assert any(new_w[k].abs().sum() > 0 for k in mem_keys if k.endswith("value_proj.weight"))
    # a zero-initialised memory starts as a no-op and training it lowers the val loss here
    assert out["val_loss"] < raw["val_loss"]


def test_init_from_errors_name_the_field(tiny_data, tmp_path):
    with pytest.raises(TngramError, match=r"run.init_from: .* \(no config.json\)"):
        tiny_config(tiny_data, "mini-tngram", [f"run.init_from={tmp_path / 'nothing'}"])
    with pytest.raises(TngramError, match="optim.trainable=memory needs a model with memory"):
        tiny_config(tiny_data, "mini-raw", ["optim.trainable=memory"])
    with pytest.raises(TngramError, match="optim.trainable must be one of"):
        tiny_config(tiny_data, "mini-raw", ["optim.trainable=some"])
    # a backbone of another width cannot be loaded
    train(tiny_config(tiny_data, "mini-raw", ["schedule.steps=1", "run.val_every=0"]), tmp_path / "raw")
    cfg = tiny_config(tiny_data, "mini-tngram", ["model.n_embd=64", f"run.init_from={tmp_path / 'raw'}"])
    with pytest.raises(TngramError, match="shapes differ"):
        train(cfg, tmp_path / "bad")


def test_recovered_fraction():
    # raw 3.70, scratch 3.35 (gain 0.35); frozen 3.42 recovers 0.28 / 0.35 = 0.8
    assert recovered_fraction(3.70, 3.35, 3.42) == pytest.approx(0.8)
    assert recovered_fraction(3.70, 3.35, 3.35) == pytest.approx(1.0)
    with pytest.raises(TngramError):
        recovered_fraction(3.7, 3.7, 3.6)

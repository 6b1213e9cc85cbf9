"""`python -m research bench step` times the trainer's optimiser step: the recipe's gradient accumulation."""

from __future__ import annotations

import torch

from research.bench.step import build_step
from tngram.train.recipes import get_recipe
from test_train_support import tiny_data  # noqa: F401  (fixture)


def test_mini_step_accumulates_the_recipes_global_batch(monkeypatch):
    cfg = get_recipe("mini-raw")
    micro = cfg.data.micro_batch_seqs * cfg.model.sequence_len
    calls = []
    real = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    step, facts = build_step("mini-raw", "fp32", paper_batch=1)
    assert facts["tokens"] == cfg.data.global_batch_tokens == facts["grad_accum"] * micro
    assert facts["grad_accum"] == cfg.data.global_batch_tokens // micro == 2
    step()
    assert len(calls) == facts["grad_accum"]          # one backward per micro-batch, one update


def test_trainer_phases_time_the_real_loop_and_restore_it(tiny_data):
    from test_train_support import tiny_config
    from research.bench.trainer import phases_of_config
    from tngram.model.gpt import GPT
    forward, backward = GPT.forward, torch.Tensor.backward
    cfg = tiny_config(tiny_data, extra=["run.checkpoint_every=2", "run.val_every=0"])
    res = phases_of_config(cfg, steps=3)          # 2 micro-steps of 4 x 64 per optimiser step
    calls = res["calls"]
    assert calls["forward"] == calls["backward"] == calls["data"] == 6
    assert calls["adam"] == calls["muon"] == calls["zero_grad"] == 3
    assert calls["eval"] == 1 and calls["checkpoint"] == 2 and calls["final_weights"] == 1
    inside = sum(res["in_step_s"].values())
    assert 0 < inside <= res["train_time_s"] and res["other_in_step_s"] >= 0
    assert res["train_time_s"] + sum(res["outside_step_s"].values()) <= res["wall_s"]
    assert GPT.forward is forward and torch.Tensor.backward is backward   # wrappers removed

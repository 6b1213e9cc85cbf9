"""Accumulated micro-steps through MemoryTrainer (tngram.hf.trainer): with row-sparse tables and
gradient_accumulation_steps = k, the micro-steps of one optimiser step run inside
accumulate_at_exit, so torch never adds one sparse gradient to another (k - 1 concatenations
per table per step otherwise, each copying the growing gradient): each table's K gradients are
concatenated once, when the window closes. The optimiser gets one gradient per table with the
rows torch's additions give, and the trained weights equal a run whose micro-steps torch adds
up itself (the same rows, summed in another order)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import plain_args, prompt, with_memory  # noqa: E402
from test_sparse_rows_coalesced import SparseAdds  # noqa: E402

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

import tngram.hf.trainer as hf_trainer  # noqa: E402
from tngram.hf import MemoryTrainer  # noqa: E402
from tngram.hf.attach import memory_modules  # noqa: E402
from tngram.kernels import sparse_rows  # noqa: E402
from tngram.optim.row_adams import LazyAdam  # noqa: E402

LR, TABLE_LR, STEPS, NORM, K = 1e-2, 5e-2, 2, 0.05, 3
IDS = prompt(6, 10, seed=7)  # 6 sequences: one optimiser step = 3 micro-steps of 2


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return len(IDS)

    def __getitem__(self, i):
        return {"input_ids": IDS[i], "labels": IDS[i]}


def _trainer(model, tmp_path, **kw) -> MemoryTrainer:
    """STEPS optimiser steps of K micro-steps, row-sparse tables with lazy Adam."""
    args = plain_args(
        tmp_path,
        steps=STEPS,
        lr=LR,
        batch=len(IDS) // K,
        norm=NORM,
        gradient_accumulation_steps=K,
        **kw,
    )
    return MemoryTrainer(
        model=model,
        args=args,
        train_dataset=Data(),
        memory_table_lr=TABLE_LR,
        memory_update="sparse",
    )


def tables_of(model):
    """Every memory's row-sparse tables (Engram's table, TN-gram's factors)."""
    return [p for m in memory_modules(model).values() for p in m.table_parameters()]


def _train(model, tmp_path, monkeypatch, windowed: bool, fail_at: int | None = None):
    """STEPS optimiser steps of K micro-steps; returns (sparse additions dispatched, the table
    gradients the table optimiser stepped on, the size of each sum made on a window's exit).
    windowed=False: accumulate_at_exit is a no-op (torch adds the micro-steps up). fail_at:
    the micro-step (0-based) whose loss raises."""
    if not windowed:
        monkeypatch.setattr(hf_trainer, "accumulate_at_exit", _nothing)
    seen: list[torch.Tensor] = []
    real = LazyAdam.step

    def step(self, closure=None):  # noqa: ANN001, ANN202
        seen.extend(p.grad for g in self.param_groups for p in g["params"] if p.grad is not None)
        return real(self, closure)

    monkeypatch.setattr(LazyAdam, "step", step)
    summed: list[int] = []  # per concatenation made on a window's exit: how many gradients
    real_summed = sparse_rows._summed

    def spy(grads):  # noqa: ANN001, ANN202
        summed.append(len(grads))
        return real_summed(grads)

    monkeypatch.setattr(sparse_rows, "_summed", spy)
    trainer = _trainer(model, tmp_path)
    if fail_at is not None:
        calls = [0]
        real_loss = trainer.compute_loss

        def compute_loss(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            calls[0] += 1
            if calls[0] > fail_at:
                raise RuntimeError("a micro-step fails")
            return real_loss(*a, **kw)

        trainer.compute_loss = compute_loss
    adds = SparseAdds()
    with adds:
        trainer.train()
    return adds.n, seen, summed


class _nothing:  # noqa: N801  (stands in for the context manager)
    def __enter__(self):
        return self

    def __exit__(self, *exc):  # noqa: ANN002
        return False


@pytest.mark.parametrize("kind", ["engram", "tngram_fused"])
def test_micro_steps_are_added_up_once_with_the_same_result(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    model = with_memory("llama", kind)
    plain = copy.deepcopy(model)
    n_tables = len(tables_of(model))
    assert n_tables == 2  # one memory in each of layers 0 and 2
    with monkeypatch.context() as m:  # each run patches LazyAdam.step for itself only
        adds, seen, summed = _train(model, tmp_path / "a", m, windowed=True)
    with monkeypatch.context() as m:
        plain_adds, plain_seen, plain_summed = _train(plain, tmp_path / "b", m, windowed=False)
    # control: torch adds each later micro-step's gradient to p.grad, per table per step
    assert plain_adds == STEPS * n_tables * (K - 1), plain_adds
    assert adds == 0
    # each table's K micro-step gradients are concatenated once per step, on the window's exit
    assert summed == [K] * (STEPS * n_tables) and plain_summed == []
    # the optimiser steps on one gradient per table per step, with the same rows as torch's
    assert len(seen) == len(plain_seen) == STEPS * n_tables
    for g, h in zip(seen, plain_seen, strict=True):
        assert g.is_sparse and h.is_sparse
        assert torch.equal(g.coalesce().indices(), h.coalesce().indices())
    got = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6, msg=name)
    assert not sparse_rows._DEFER[0] and not sparse_rows._SET_ASIDE


def test_a_failing_micro_step_leaves_no_deferral_behind(tmp_path, monkeypatch):
    """A micro-step that raises mid-window closes the window: later backwards anywhere add
    their gradients to p.grad as usual."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    model = with_memory("llama", "engram")
    with pytest.raises(RuntimeError, match="a micro-step fails"):
        _train(model, tmp_path, monkeypatch, windowed=True, fail_at=1)
    assert not sparse_rows._DEFER[0] and not sparse_rows._SET_ASIDE
    model.zero_grad()
    model(IDS[:2], labels=IDS[:2], use_cache=False).loss.backward()
    assert all(t.grad is not None and t.grad.is_sparse for t in tables_of(model))


def test_gradient_checkpointing_changes_nothing(tmp_path, monkeypatch):
    """With gradient checkpointing a layer's forward (its memory's row compaction included)
    runs again inside the backward, inside the accumulation window: the weights after two
    steps of three micro-steps equal those without checkpointing, bit for bit (the same ops
    on the same values; the CPU kernels are deterministic)."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    from transformers import TrainingArguments

    # transformers 5.24 renamed the flag (the old name warns); 5.20 has only the old one
    flag = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    out = []
    for ckpt in (False, True):
        model = with_memory("llama", "tngram_fused")
        trainer = _trainer(model, tmp_path / str(ckpt), **{flag: ckpt})
        trainer.train()
        assert getattr(model.model, f"is_{flag}") == ckpt  # it was on, or off
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, p in out[0].items():
        assert torch.equal(out[1][name], p), name

"""transformers' Trainer with a memory: the recipe (tngram.hf.trainer) trains the memory tables
and factors without weight decay at their own learning rate, where Trainer's default optimiser
decays them; num_parameters(exclude_embeddings=True) leaves out every memory table alike."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import prompt, with_memory  # noqa: E402

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

from transformers import Trainer, TrainingArguments  # noqa: E402

from tngram.hf import MemoryTrainer, memory_optimizer  # noqa: E402

LR, WD, STEPS = 0.05, 0.5, 3


class Batches(torch.utils.data.Dataset):
    def __init__(self, n: int = 8, length: int = 8) -> None:
        self.ids = prompt(n, length, seed=5)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, learning_rate=LR,
                             weight_decay=WD, lr_scheduler_type="constant", warmup_steps=0,
                             per_device_train_batch_size=4, use_cpu=True, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             seed=0, data_seed=0, **kw)


def untouched_rows(model) -> torch.Tensor:
    """Rows of layer 0's Engram table that no training batch reads (zero gradient on all data)."""
    model.zero_grad()
    ids = Batches().ids
    model(ids, labels=ids, use_cache=False).loss.backward()
    grad = model.model.layers[0].ngram_memory.table.weight.grad
    model.zero_grad()
    rows = (grad.abs().sum(1) == 0).nonzero().flatten()
    assert 0 < len(rows) < grad.shape[0]
    return rows


@pytest.mark.parametrize("how", ["plain", "memory_trainer", "optimizers"])
def test_untouched_table_rows_decay_only_with_the_plain_trainer(tmp_path, how):
    model = with_memory("llama", "engram").train()
    table = model.model.layers[0].ngram_memory.table.weight
    rows = untouched_rows(model)
    before = table.detach()[rows].clone()
    a = args(tmp_path)
    if how == "plain":
        trainer = Trainer(model=model, args=a, train_dataset=Batches())
    elif how == "memory_trainer":
        trainer = MemoryTrainer(model=model, args=a, train_dataset=Batches(), memory_table_lr=0.2)
    else:
        trainer = Trainer(model=model, args=a, train_dataset=Batches(),
                          optimizers=(memory_optimizer(model, a, table_lr=0.2), None))
    trainer.train()
    after = table.detach()[rows]
    if how == "plain":   # AdamW's decoupled decay: p <- p (1 - lr wd) per step, no Adam update
        torch.testing.assert_close(after, before * (1 - LR * WD) ** STEPS, rtol=1e-6, atol=0)
    else:
        assert torch.equal(after, before)
        groups = {g["group"]: g for g in trainer.optimizer.param_groups}
        assert groups["memory_table"]["lr"] == 0.2 and groups["memory_table"]["weight_decay"] == 0
        assert groups["memory_control"]["weight_decay"] == 0
        assert groups["decay"]["weight_decay"] == WD and groups["decay"]["lr"] == LR


def test_recipe_groups_cover_every_trainable_parameter_once(tmp_path):
    model = with_memory("qwen2", "tngram")
    for n, p in model.named_parameters():          # a frozen backbone is left out
        p.requires_grad_("ngram_memory" in n or "embed_tokens" in n)
    opt = memory_optimizer(model, args(tmp_path), table_lr=0.1)
    named = {id(p): n for n, p in model.named_parameters()}
    got = [named[id(p)] for g in opt.param_groups for p in g["params"]]
    assert sorted(got) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    by_group = {g["group"]: {named[id(p)] for p in g["params"]} for g in opt.param_groups}
    assert by_group["memory_table"] == {"model.layers.0.ngram_memory.factors",
                                        "model.layers.2.ngram_memory.factors"}
    assert all("ngram_memory" in n for n in by_group["memory_control"])
    assert by_group["decay"] == {"model.embed_tokens.weight"} | {
        n for n in got if "ngram_memory" in n and n not in by_group["memory_table"]
        and n not in by_group["memory_control"] and "bias" not in n and "norm" not in n}
    assert type(opt).__name__ == "AdamW"                 # Trainer's class for the default optim


@pytest.mark.parametrize("memory_update", ["dense", "sparse"])
def test_logs_the_same_learning_rates_whatever_the_update(tmp_path, memory_update):
    """Trainer logs its first param group's lr as learning_rate: the recipe puts the tables last,
    so that is the args' lr with dense and row-sparse updates alike (dense logged the table lr
    there), and MemoryTrainer logs the tables' lr beside it, on the same schedule."""
    a = args(tmp_path, logging_steps=1, max_grad_norm=1.0)
    a.logging_strategy, a.lr_scheduler_type = "steps", "linear"
    trainer = MemoryTrainer(model=with_memory("llama", "engram"), args=a, train_dataset=Batches(),
                            memory_table_lr=0.2, memory_update=memory_update)
    trainer.train()
    logged = [(h["learning_rate"], h["memory_table_lr"]) for h in trainer.state.log_history
              if "learning_rate" in h]
    want = [(LR * f, 0.2 * f) for f in (1, 2 / 3, 1 / 3)]
    assert len(logged) == len(want)
    assert all(g == pytest.approx(w) for g, w in zip(logged, want))


@pytest.mark.parametrize("norm", [1.0, 0.0])
def test_plain_trainer_with_row_sparse_tables_is_refused_up_front(tmp_path, norm):
    """A plain Trainer takes the gradient norm with torch's clip_grad_norm_ at every step (with
    max_grad_norm=0 too), which fails on row-sparse gradients: a raw torch error at the first
    step. memory_optimizer refuses sparse / rowwise in one line naming MemoryTrainer, which
    trains the same model."""
    from tngram.common import TngramError

    model = with_memory("llama", "engram")
    for update in ("sparse", "rowwise"):
        with pytest.raises(TngramError, match=r"use MemoryTrainer\(\.\.\., memory_update=\.\.\.\)"):
            memory_optimizer(model, args(tmp_path, max_grad_norm=norm), memory_update=update)
    with pytest.raises(NotImplementedError):  # what the refusal saves the user from
        from tngram.hf.trainer import _memory_optimizer

        a = args(tmp_path, max_grad_norm=norm)
        opt = _memory_optimizer(model, a, None, None, "sparse", False)
        Trainer(model=model, args=a, train_dataset=Batches(), optimizers=(opt, None)).train()
    MemoryTrainer(model=model, args=args(tmp_path, max_grad_norm=norm), train_dataset=Batches(),
                  memory_update="sparse").train()


@pytest.mark.parametrize("kind", ["tngram", "engram", "oe"])
def test_num_parameters_excludes_every_memory_table(kind):
    model = with_memory("llama", kind)
    named = dict(model.named_parameters())
    tables = {"tngram": "factors", "engram": "table.weight", "oe": "table.weight"}[kind]
    embeddings = {"model.embed_tokens.weight"} | {n for n in named if "ngram_memory" in n
                                                  and n.endswith(tables)}
    assert model.num_parameters() == sum(p.numel() for p in named.values())
    assert model.num_parameters(exclude_embeddings=True) == \
        sum(p.numel() for n, p in named.items() if n not in embeddings)
    for p in model.parameters():
        p.requires_grad_(False)
    assert model.num_parameters(only_trainable=True, exclude_embeddings=True) == 0

"""memory_catchup through Trainer (tngram.hf.table_update): MemoryTrainer(memory_update="sparse",
memory_catchup=True) trains to the numbers of our CLI trainer's path (tngram.train.trainer_setup:
setup_memory_update(..., catchup) for the tables, clip_grad_norm, settle_tables at the end),
written out here step by step; without catch-up the numbers differ (the flag acts); bad
combinations get our trainer's one line."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import plain_args, prompt, with_memory  # noqa: E402

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")


from tngram.common import TngramError  # noqa: E402
from tngram.hf import MemoryTrainer, memory_optimizer  # noqa: E402
from tngram.hf.trainer import memory_param_groups_for_trainer  # noqa: E402
from tngram.optim.memory_update import (  # noqa: E402
    clip_grad_norm,
    settle_tables,
    setup_memory_update,
)

LR, TABLE_LR, NORM = 1e-2, 5e-2, 0.05
IDS = prompt(4, 10, seed=5)  # one sequence per step: rows read at one step are not at the next


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return len(IDS)

    def __getitem__(self, i):
        return {"input_ids": IDS[i], "labels": IDS[i]}


class InOrder(MemoryTrainer):
    """The batches in data order (the reference reads them so)."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def args(tmp_path, **kw):
    return plain_args(tmp_path, steps=len(IDS), lr=LR, batch=1, norm=NORM, **kw)


def cli_path(model, a, mode):
    """Our trainer's calls, in its order: setup_memory_update(catchup=True) on the recipe's
    groups, AdamW on the rest, clip_grad_norm, the steps, settle_tables after the last one."""
    groups = memory_param_groups_for_trainer(model, a, TABLE_LR)
    betas = (a.adam_beta1, a.adam_beta2)
    tables, rest = setup_memory_update(model, groups, mode, betas, a.adam_epsilon, True)
    main = torch.optim.AdamW(rest, lr=LR, betas=betas, eps=a.adam_epsilon, weight_decay=0.0)
    model.train()
    for i in range(len(IDS)):
        x = IDS[i : i + 1]
        model(x, labels=x, use_cache=False).loss.backward()
        clip_grad_norm(model.parameters(), NORM)
        main.step()
        tables.step()
        model.zero_grad()
    settle_tables([tables])
    return model


def trained(model, tmp_path, mode, catchup):
    trainer = InOrder(
        model=model,
        args=args(tmp_path),
        train_dataset=Data(),
        memory_table_lr=TABLE_LR,
        memory_update=mode,
        memory_catchup=catchup,
    )
    trainer.train()
    return model


@pytest.mark.parametrize("mode", ["sparse", "rowwise"])
def test_catchup_equals_the_cli_path(tmp_path, mode):
    model = with_memory("llama", "engram")
    want = cli_path(copy.deepcopy(model), args(tmp_path), mode)
    without = trained(copy.deepcopy(model), tmp_path, mode, False)
    got = dict(trained(model, tmp_path, mode, True).named_parameters())
    lazy = dict(without.named_parameters())
    moved = 0
    for name, p in want.named_parameters():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6, msg=name)
        if "ngram_memory.table" in name:  # catch-up moved rows that plain lazy Adam left
            moved += int((got[name] != lazy[name]).any(1).sum())
    assert moved > 0


def test_catchup_needs_a_lazy_update(tmp_path):
    model = with_memory("llama", "engram")
    with pytest.raises(TngramError, match="memory_catchup=True needs memory_update="):
        MemoryTrainer(model=model, args=args(tmp_path), memory_catchup=True)
    with pytest.raises(TngramError, match="memory_catchup=True needs memory_update="):
        memory_optimizer(model, args(tmp_path), memory_catchup=True)
    with pytest.raises(TngramError, match="memory_catchup must be True or False"):
        memory_optimizer(model, args(tmp_path), memory_update="sparse", memory_catchup="yes")


def test_evaluate_sees_the_settled_tables(tmp_path):
    """evaluate() runs on the tables with every row's owed moves applied and restores them."""
    from tngram.hf import settle_memory_tables

    model = with_memory("llama", "engram")
    a = args(tmp_path, per_device_eval_batch_size=len(IDS))
    trainer = InOrder(
        model=model,
        args=a,
        train_dataset=Data(),
        eval_dataset=Data(),
        memory_table_lr=TABLE_LR,
        memory_update="sparse",
        memory_catchup=True,
    )
    super(MemoryTrainer, trainer).train()  # Trainer's train: nothing settled yet
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        owed = model(IDS, labels=IDS, use_cache=False).loss
    got = trainer.evaluate()["eval_loss"]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # restored
    settle_memory_tables(trainer.optimizer)
    model.eval()
    with torch.no_grad():
        settled = model(IDS, labels=IDS, use_cache=False).loss
    assert float(owed) != float(settled)  # the rows were owed moves
    assert got == pytest.approx(float(settled), rel=1e-6)

"""A memory-only fine-tune of a bitsandbytes-quantized base on the CPU (8-bit, and 4-bit): the
memory trains with MemoryTrainer while the quantized backbone stays as loaded, the loss falls,
and the saved memory reloads onto a fresh quantized base with the same logits; what cannot work
(a trainable backbone on a quantized base) is refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import MEMORIES, plain_args, prompt, tiny_model, transformers  # noqa: E402

pytest.importorskip(
    "bitsandbytes", reason="bitsandbytes is not installed (the hf extra installs it)"
)

from tngram.common import TngramError  # noqa: E402
from tngram.hf import MemoryTrainer, add_memory, load_memory, save_memory  # noqa: E402

BITS = (8, 4)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tiny_model("llama").save_pretrained(path)
    return path


def quantized(base_dir, bits):
    q = transformers.BitsAndBytesConfig(**{f"load_in_{bits}bit": True})
    return transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, quantization_config=q, device_map="cpu"
    ).eval()


def logits(model, x):
    with torch.no_grad():
        return model(x, use_cache=False).logits


@pytest.mark.parametrize("bits", BITS)
def test_memory_only_fine_tune_saves_and_reloads_exactly(base_dir, bits, tmp_path):
    model = quantized(base_dir, bits)
    assert model.is_quantized
    x = prompt(batch=8, length=12)
    plain = logits(model, x)
    add_memory(model, MEMORIES["engram"], layers=(0,), memory_seed=1, trainable="memory")
    backbone = {n: p.detach().clone() for n, p in model.named_parameters() if "ngram" not in n}
    memory = {n: p.detach().clone() for n, p in model.named_parameters() if "ngram" in n}
    args = plain_args(tmp_path / "run", steps=8, lr=1e-2, batch=8, norm=1.0)
    args.logging_strategy, args.logging_steps = "steps", 1
    trainer = MemoryTrainer(
        model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in x]
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.05  # the same batch each step
    now = dict(model.named_parameters())
    assert all(torch.equal(now[n], t) for n, t in backbone.items())  # int8 / 4-bit as loaded
    assert all(not torch.equal(now[n], t) for n, t in memory.items() if t.numel() > 1)
    model.eval()
    trained = logits(model, x)
    assert not torch.equal(trained, plain)
    save_memory(model, tmp_path / "memory")
    fresh = load_memory(quantized(base_dir, bits), tmp_path / "memory")
    assert torch.equal(logits(fresh, x), trained)
    kw = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(fresh.generate(x[:2], **kw), fresh.generate(x[:2], use_cache=False, **kw))
    with pytest.raises(TngramError, match=r"config\.quantization_config is \{"):
        load_memory(tiny_model("llama"), tmp_path / "memory")  # the full-precision base


def test_what_cannot_train_is_refused(base_dir, tmp_path):
    model = quantized(base_dir, 8)
    with pytest.raises(TngramError, match="trainable='all' on a quantized base"):
        add_memory(model, MEMORIES["engram"], layers=(0,))
    add_memory(model, MEMORIES["engram"], layers=(0,), trainable="memory")
    model.model.norm.weight.requires_grad_(True)  # a float backbone parameter set to train
    args = plain_args(tmp_path, steps=1, lr=1e-2, batch=2, norm=1.0)
    with pytest.raises(TngramError, match=r"model\.norm\.weight would train, but the base is"):
        MemoryTrainer(model=model, args=args, train_dataset=[])
    with pytest.raises(ValueError, match="purely quantized"):  # transformers' own Trainer
        transformers.Trainer(model=model, args=args, train_dataset=[])

"""Tiny random transformers models of each supported family (no downloads) for the tngram.hf
tests, and the memory configs they carry. Memories use non-zero value/conv init so they change
the logits from the first step (with the default zero init they would start as a no-op and every
exactness test would pass trivially)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

import tngram.hf  # noqa: E402,F401  (switches the integration on)
from tngram.memory.engram import EngramConfig  # noqa: E402
from tngram.memory.overencoding import OverEncodingConfig  # noqa: E402
from tngram.memory.tngram import TNGramConfig  # noqa: E402

VOCAB = 61  # odd, so nothing lines up with powers of two by accident
FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox")
SPECIAL = dict(pad_token_id=0, bos_token_id=None, eos_token_id=None)


def tiny_config(family: str):
    t = transformers
    common = dict(vocab_size=VOCAB, **SPECIAL)
    if family == "gpt2":
        return t.GPT2Config(n_embd=32, n_layer=3, n_head=4, n_positions=128, **common)
    if family == "gpt_neox":
        return t.GPTNeoXConfig(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=128,
            **common,
        )
    cls = {"llama": t.LlamaConfig, "qwen2": t.Qwen2Config, "mistral": t.MistralConfig}[family]
    return cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **common,
    )


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()


MEMORIES = {
    "tngram": TNGramConfig(
        max_ngram=3, cp_rank=8, zero_init_value=False, zero_init_conv=False, fused=False
    ),
    "tngram_fused": TNGramConfig(
        max_ngram=4, cp_rank=8, zero_init_value=False, zero_init_conv=False
    ),
    "engram": EngramConfig(
        max_ngram=3,
        n_head_per_ngram=2,
        n_embed_per_ngram=16,
        table_budget=(31, 37),
        pad_id=0,
        zero_init_value=False,
        zero_init_conv=False,
    ),
    "oe": OverEncodingConfig(
        max_ngram=3, n_slices=2, table_rows=97, zero_init_proj=False, average=False
    ),
}


def with_memory(family: str, kind: str, layers=(0, 2), seed: int = 0, **memory_fields):
    """tiny_model(family) with MEMORIES[kind] (its fields changed by memory_fields) at layers."""
    import dataclasses

    from tngram.hf import add_memory

    model = tiny_model(family, seed)
    cfg = dataclasses.replace(MEMORIES[kind], **memory_fields)
    return add_memory(model, cfg, layers=layers, memory_seed=seed + 1)


def prompt(batch: int = 2, length: int = 6, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


def plain_args(tmp_path, *, steps: int, lr: float, batch: int, norm: float, **kw):
    """TrainingArguments that leave only what the table-update tests compare: constant lr, no
    weight decay or warm-up, plain AdamW, clipping at `norm`, CPU, no logging or saving."""
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        learning_rate=lr,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=batch,
        max_grad_norm=norm,
        optim="adamw_torch",
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **kw,
    )

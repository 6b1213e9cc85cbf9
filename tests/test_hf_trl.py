"""TRL's SFTTrainer trains a memory (docs/HF.md "TRL"): a tiny local Llama with add_memory, a
word-level tokenizer built in memory, text examples; the loss falls, only the memory moves, and
save_memory / load_memory give the trained model back on a fresh base. Offline."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import MEMORIES, VOCAB, tiny_model  # noqa: E402

pytest.importorskip("trl", reason="trl is not installed (the trl extra; make test installs it)")
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from tngram.hf import add_memory, load_memory, memory_optimizer, save_memory  # noqa: E402


def word_tokenizer() -> PreTrainedTokenizerFast:
    """VOCAB ids: <pad> 0 (the tiny models' pad_token_id), <eos> 1, words w2 .. w{VOCAB-1}."""
    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(2, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def texts(n: int = 16) -> list[str]:
    """n texts, four distinct ones of ten random words repeated (so a few steps learn them)."""
    g = torch.Generator().manual_seed(0)
    four = [" ".join(f"w{i}" for i in torch.randint(2, VOCAB, (10,), generator=g)) for _ in "abcd"]
    return [four[i % 4] for i in range(n)]


def test_sft_trainer_trains_and_saves_the_memory(tmp_path):
    model = add_memory(tiny_model("llama"), MEMORIES["engram"], layers=(1,), trainable="memory")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=8,
        learning_rate=1e-2,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,  # SFTConfig's default True leaves model.forward under bf16 autocast after
    )  # training (accelerate wraps it), so the trained model's logits would not be float32's
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([{"text": t} for t in texts()]),
        processing_class=word_tokenizer(),
        optimizers=(memory_optimizer(model, args, table_lr=1e-1), None),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1  # 8 steps over the same 4 texts
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("ngram_memory" in n for n in moved)  # the memory alone trained
    assert {n for n in before if "ngram_memory" in n and before[n].numel() > 1} <= moved
    save_memory(model.eval(), tmp_path / "memory")
    fresh = load_memory(tiny_model("llama"), tmp_path / "memory").eval()
    ids = word_tokenizer()(texts(2), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)

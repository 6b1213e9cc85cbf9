"""PEFT and the memory: LoRA on the memory's own projections is honoured at every sequence
length (the fused K/V path of GatedFusion runs only for plain nn.Linear projections), so the
LoRA model equals its merged copy, cached generation equals recomputation from a prompt longer
than the fused path's 64 rows, and Trainer trains the LoRA weights inside the memory."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import prompt, with_memory

peft = pytest.importorskip("peft", reason="peft is not installed (the hf extra has it)")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

from transformers import Trainer, TrainingArguments

from tngram.kernels.policy import current_policy

MEMORY_LINEARS = ["fusion.key_proj.0", "fusion.value_proj"]


def lora_model(kind: str = "tngram", targets="all-linear"):
    model = with_memory("llama", kind)
    # init_lora_weights=False: B is random too, so the adapter changes the output from the start
    cfg = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(3)
    return model, peft.get_peft_model(model, cfg).eval()


def test_prompt_reaches_the_fused_path():
    """The lengths below really cross the fused path's threshold (else the test is moot)."""
    assert current_policy().fuse_kv and current_policy().fuse_kv_min_rows <= 70


@pytest.mark.parametrize("kind", ["tngram", "engram"])
def test_lora_on_memory_projections_equals_the_merged_model(kind):
    """At 100 tokens (fused path) and 10 tokens (unfused) the LoRA model equals the same model
    with the adapter merged into plain nn.Linear weights (W + s·BA, computed by peft), and the
    adapter in the memory does change the output (the test would pass without it otherwise)."""
    _, pm = lora_model(kind)
    x = prompt(2, 100, seed=4)
    merged = copy.deepcopy(pm).merge_and_unload().eval()
    names = [n for n, m in merged.named_modules() if n.endswith(tuple(MEMORY_LINEARS))]
    assert names and all(type(merged.get_submodule(n)) is torch.nn.Linear for n in names)
    with torch.no_grad():
        for length in (100, 10):
            got, want = pm(x[:, :length]).logits, merged(x[:, :length]).logits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        with pm.disable_adapter():
            off = pm(x).logits
        assert (off - pm(x).logits).abs().max() > 1e-3
        # the memory's own LoRA matters at the fused length: only the memory's adapters off
        only_memory = copy.deepcopy(pm)
        for n, m in only_memory.named_modules():
            if hasattr(m, "lora_B") and "ngram_memory" not in n:
                torch.nn.init.zeros_(m.lora_B["default"].weight)
        no_memory_lora = copy.deepcopy(only_memory)
        for n, m in no_memory_lora.named_modules():
            if hasattr(m, "lora_B") and "ngram_memory" in n:
                torch.nn.init.zeros_(m.lora_B["default"].weight)
        diff = (only_memory(x).logits - no_memory_lora(x).logits).abs().max()
    assert diff > 1e-4


def test_lora_memory_cached_generation_equals_recomputation():
    """A 70-token prompt (prefill on the fused length, decode steps on one row each)."""
    _, pm = lora_model()
    x = prompt(1, 70, seed=6)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = pm.generate(input_ids=x, **kw)
        plain = pm.generate(input_ids=x, use_cache=False, **kw)
    assert torch.equal(cached, plain)


def test_trainer_trains_lora_inside_the_memory(tmp_path):
    _, pm = lora_model(targets=MEMORY_LINEARS)
    pm.train()
    ids = prompt(8, 80, seed=5)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    before = {n: p.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}
    assert before and all("ngram_memory" in n and "lora_" in n for n in before)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=pm, args=args, train_dataset=Data()).train()
    after = dict(pm.named_parameters())
    assert all(not torch.equal(after[n], p) for n, p in before.items())

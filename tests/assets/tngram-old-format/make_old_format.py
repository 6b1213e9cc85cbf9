"""Writes this folder's files with the code of commit 3afa763, where TNGramConfig held 27 fields
(the variants were fields of kind "tngram"): run it from a checkout of that commit,

    git worktree add /tmp/old 3afa763 && PYTHONPATH=/tmp/old python make_old_format.py

run/          a run folder: config.json (kind "tngram" with all 27 fields: every variant field
              off its default), model.safetensors (+ its record), expected.safetensors (ids and
              the logits the old code computed)
hf-export/    config.json of the same model as `tngram export` writes it (the exported folder's
              model.safetensors holds the run's tensors under "model."; the test rebuilds it)
hf-memory/    save_memory of a hybrid TN-gram (orders summed, hashed orders 2..3) on the tiny
              llama of tests/hf_tiny.py, and expected.safetensors: h, ids and each memory
              module's output y = memory(h, ids) under the old code
tests/test_tngram_config_kinds.py loads each into today's kinds.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/ (hf_tiny)

from tngram.memory.tngram import TNGramConfig  # noqa: E402
from tngram.model.gpt import GPT  # noqa: E402
from tngram.train.checkpoint import save_final_weights, save_run_config  # noqa: E402
from tngram.train.recipes import get_recipe  # noqa: E402

VOCAB = 64
ALL_SWITCHES = dict(order_combine="sum", kv_rank=5, share_factors=True, hash_orders=(2, 3),
                    hash_heads=2, hash_embed=4, hash_budget=11, hash_seed=3)
HYBRID = dict(order_combine="sum", hash_orders=(2, 3), hash_heads=2, hash_embed=4, hash_budget=13)


def run_folder() -> None:
    base = get_recipe("mini-tngram")
    mem = replace(base.model.memory, max_ngram=3, cp_rank=8, zero_init_value=False,
                  zero_init_conv=False, **ALL_SWITCHES)
    cfg = replace(base, name="old-format-all-variants",
                  model=replace(base.model, vocab_size=VOCAB, n_layer=2, n_embd=32, n_head=2,
                                n_kv_head=1, sequence_len=64, memory_layers=(0, 1), memory=mem))
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("proj.weight") and p.abs().sum() == 0:
                p.normal_(0, 0.05)  # zero-init projections would hide the memory
    run = HERE / "run"
    run.mkdir(exist_ok=True)
    save_run_config(run, cfg.to_dict())
    save_final_weights(run, model, 1)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    save_file({"ids": ids, "logits": logits}, str(run / "expected.safetensors"))
    from tngram.hf.gpt_model import from_gpt, register

    register()
    hf = HERE / "hf-export"
    hf.mkdir(exist_ok=True)
    from_gpt(model).config.to_json_file(str(hf / "config.json"))


def hf_memory() -> None:
    from hf_tiny import tiny_model
    from tngram.hf import add_memory, memory_modules, save_memory

    cfg = TNGramConfig(max_ngram=3, cp_rank=8, zero_init_value=False, zero_init_conv=False,
                       **HYBRID)
    model = add_memory(tiny_model("llama"), cfg, layers=(0, 2), memory_seed=1)
    out = HERE / "hf-memory"
    save_memory(model, out, overwrite=True)
    g = torch.Generator().manual_seed(2)
    h, ids = torch.randn(2, 10, 32, generator=g), torch.randint(0, 61, (2, 10), generator=g)
    tensors = {"h": h, "ids": ids}
    with torch.no_grad():
        for name, mod in memory_modules(model).items():
            tensors[f"y.{name}"] = mod(h, ids)
    save_file(tensors, str(out / "expected.safetensors"))


if __name__ == "__main__":
    run_folder()
    hf_memory()
    for p in sorted(HERE.rglob("*")):
        if p.is_file():
            print(p.relative_to(HERE), p.stat().st_size)
    print(json.dumps(json.loads((HERE / "run" / "config.json").read_text())["model"]["memory"]))

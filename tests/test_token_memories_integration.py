"""The product-key, STEM and per-layer embedding memories through the paths users take: the real
trainer with optim.memory_update=sparse|rowwise (row-sparse table updates), tngram.hf.add_memory
on a tiny transformers model (causal, generate with the cache = recomputation), and
`tngram export --hf` of a run (the exported model's logits equal ours)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_train_support import (  # noqa: E402,F401
    TINY_VOCAB, single_thread, tiny_config, tiny_data, weights)

from tngram.memory.per_layer_embedding import PerLayerEmbeddingConfig  # noqa: E402
from tngram.memory.product_key import ProductKeyConfig  # noqa: E402
from tngram.memory.stem import StemConfig  # noqa: E402
from tngram.model.gpt import GPT  # noqa: E402

RECIPES = {"mini-pkm": ["model.memory.n_keys=16", "model.memory.key_dim=8", "model.memory.topk=4"],
           "mini-stem": ["model.memory.hidden=48"],
           "mini-ple": ["model.memory.ple_dim=16", "model.memory_layers=0,1"]}
# non-zero output projections, so the table gradient of step 1 is not zero
NONZERO_INIT = {"mini-stem": ["model.memory.zero_init_down=false"],
                "mini-ple": ["model.memory.zero_init_proj=false"]}
HF_MEMORIES = {
    "pkm": ProductKeyConfig(n_keys=8, key_dim=8, topk=3, n_heads=2, shared_values=True),
    "stem": StemConfig(hidden=40, zero_init_down=False),
    "ple": PerLayerEmbeddingConfig(ple_dim=8, zero_init_proj=False),
}


@pytest.mark.parametrize("mode", ["sparse", "rowwise"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_trainer_updates_only_the_rows_read(tiny_data, tmp_path, recipe, mode):
    """Two steps of the real trainer with row-sparse table updates: the loss is finite, the table
    rows no token of the run read (step 2's gradient) keep their initial values, and rows move."""
    from tngram.train.loop import train
    sets = RECIPES[recipe] + ["schedule.steps=2", "schedule.warmdown_steps=0",
                              "run.checkpoint_every=0", "run.val_every=0",
                              f"optim.memory_update={mode}"]
    cfg = tiny_config(tiny_data, recipe, sets + NONZERO_INIT.get(recipe, []))
    with single_thread():
        summary = train(cfg, tmp_path)
    assert summary["val_loss"] == summary["val_loss"]            # not NaN
    torch.manual_seed(cfg.run.seed)
    init = GPT(cfg.model).state_dict()
    w = weights(tmp_path)
    table = {"mini-pkm": "memory.values", "mini-stem": "memory.up.weight",
             "mini-ple": "memory.table.weight"}[recipe]
    keys = [k for k in w if k.endswith(table)]
    assert keys
    moved = torch.stack([(w[k] != init[k]).any(1) for k in keys]).any(0)
    assert 0 < int(moved.sum()) < moved.numel()


# ---- tngram.hf.add_memory ---------------------------------------------------------------------
def hf_with(kind: str, family: str = "llama"):
    pytest.importorskip("transformers")
    from hf_tiny import tiny_model
    from tngram.hf import add_memory
    return add_memory(tiny_model(family), HF_MEMORIES[kind], layers=(0, 2), memory_seed=1)


@pytest.mark.parametrize("kind", list(HF_MEMORIES))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_add_memory_is_causal_and_changes_the_model(kind, family):
    model = hf_with(kind, family)
    from hf_tiny import VOCAB, prompt, tiny_model
    plain = tiny_model(family)
    x = prompt(2, 10)
    t = 6
    y = x.clone()
    y[:, t] = (x[:, t] + 7) % (VOCAB - 1) + 1
    with torch.no_grad():
        a, b, p = model(x).logits, model(y).logits, plain(x).logits
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-4
    assert (a - p).abs().max() > 1e-4                       # the memory is in the forward
    if kind == "pkm":                                       # Memory+: one value table
        from tngram.hf import memory_modules
        mods = list(memory_modules(model).values())
        assert mods[0].values is mods[1].values


@pytest.mark.parametrize("kind", list(HF_MEMORIES))
def test_add_memory_generate_with_cache_equals_recomputation(kind):
    model = hf_with(kind)
    from hf_tiny import prompt
    x = prompt(2, 6)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(model.generate(x, **kw), model.generate(x, use_cache=False, **kw))


# ---- export ------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_export_logits_equal_ours(tiny_data, tmp_path, recipe):
    pytest.importorskip("tokenizers")
    from tngram.cli import main
    from tngram.train.checkpoint import save_final_weights, save_run_config
    cfg = tiny_config(tiny_data, recipe, RECIPES[recipe])
    torch.manual_seed(0)
    model = GPT(cfg.model).eval()
    with torch.no_grad():                          # non-zero output projections
        for n, p in model.named_parameters():
            if n.endswith(("proj.weight", "down.weight")) and not p.any():
                p.normal_(0, 0.05)
    run = tmp_path / "run"
    run.mkdir()
    save_run_config(run, cfg.to_dict())
    save_final_weights(run, model, 1)
    (run / "tokenizer.model").write_bytes((tiny_data / "tokenizer.model").read_bytes())
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    import tngram.hf  # noqa: F401
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["gpt"]["memory"]["kind"] == cfg.model.memory.kind
    x = torch.randint(0, TINY_VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=1e-6)

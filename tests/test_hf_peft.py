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


# ---- the two orders ------------------------------------------------------------------------


def test_add_memory_after_get_peft_model_is_refused_naming_the_order():
    from tngram.common import TngramError
    from tngram.hf import add_memory

    from hf_tiny import MEMORIES, tiny_model

    pm = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    for target in (pm, pm.base_model.model):
        with pytest.raises(TngramError, match="add the memory to the base model first"):
            add_memory(target, MEMORIES["tngram"])
    assert not any("ngram_memory" in n for n, _ in pm.named_modules())


def memory_adapter(kind: str = "tngram"):
    """add_memory first, then LoRA on the attention with the memory in modules_to_save; the
    memory's trained copy is moved off its start so that a lost memory would show."""
    model = with_memory("llama", kind)
    cfg = peft.LoraConfig(
        r=2,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
        modules_to_save=["ngram_memory"],
    )
    torch.manual_seed(4)
    pm = peft.get_peft_model(model, cfg).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".modules_to_save." in n:
                p.add_(0.05 * torch.randn_like(p))
    return pm


@pytest.mark.parametrize("kind", ["tngram", "engram"])
def test_adapter_saves_the_memory_and_reloads_exactly(tmp_path, kind):
    from safetensors.torch import load_file

    pm = memory_adapter(kind)
    x = prompt(2, 9)
    pm.save_pretrained(tmp_path / "adapter")
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(".ngram_memory." in k for k in keys)
    again = peft.PeftModel.from_pretrained(with_memory("llama", kind), tmp_path / "adapter").eval()
    fresh = with_memory("llama", kind)
    with torch.no_grad():
        want = pm(x).logits
        assert torch.equal(again(x).logits, want)
        assert not torch.equal(fresh(x).logits, want)  # the adapter's memory is not the start


def test_adapter_with_memory_refuses_a_base_without_memory(tmp_path):
    from tngram.common import TngramError

    from hf_tiny import tiny_model

    memory_adapter().save_pretrained(tmp_path / "adapter")
    with pytest.raises(TngramError, match="the base model has no memory"):
        peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")


def test_transformers_adapter_loading_keeps_the_memory_or_refuses(tmp_path):
    """transformers' own paths (model.load_adapter, AutoModelForCausalLM.from_pretrained on an
    adapter folder) and peft's AutoPeftModelForCausalLM on an adapter saved without task_type:
    exact where the base has the memory, one line where it has none (transformers alone dropped
    the memory weights, listing them as unexpected; AutoPeft could not import the class)."""
    import json

    from transformers import AutoModelForCausalLM

    from hf_tiny import MEMORIES, tiny_model
    from tngram.common import TngramError
    from tngram.hf import add_memory

    tiny_model("llama").save_pretrained(tmp_path / "base")
    with_memory("llama", "engram").save_pretrained(tmp_path / "with-memory")
    x = prompt(2, 9)
    lora = dict(r=2, target_modules=["q_proj"], modules_to_save=["ngram_memory"],
                init_lora_weights=False)
    want = {}
    for base in ("base", "with-memory"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / base)
        if base == "base":
            model = add_memory(model, MEMORIES["engram"], layers=(0, 2), memory_seed=1)
        torch.manual_seed(3)
        pm = peft.get_peft_model(model, peft.LoraConfig(**lora)).eval()
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if ".modules_to_save." in n:
                    p.add_(0.05 * torch.randn_like(p))
            want[base] = pm(x).logits
        pm.save_pretrained(tmp_path / f"adapter-{base}")
    mapping = json.loads((tmp_path / "adapter-base" / "adapter_config.json").read_text())
    assert mapping["auto_mapping"]["base_model_class"] == "AutoModelForCausalLM"
    # onto a model with the memory: exact
    mem = add_memory(tiny_model("llama"), MEMORIES["engram"], layers=(0, 2), memory_seed=1)
    mem.load_adapter(str(tmp_path / "adapter-base"))
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter-with-memory").eval()
    auto_peft = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter-with-memory")
    with torch.no_grad():
        assert torch.equal(mem.eval()(x).logits, want["base"])
        assert torch.equal(auto(x).logits, want["with-memory"])
        assert torch.equal(auto_peft.eval()(x).logits, want["with-memory"])
    # onto a model without it: one line, the model left without the adapter
    plain = tiny_model("llama")
    with pytest.raises(TngramError, match="holds n-gram memory weights .* has no memory"):
        plain.load_adapter(str(tmp_path / "adapter-base"))
    assert not any("lora_" in n for n, _ in plain.named_parameters())
    with pytest.raises(TngramError, match="holds n-gram memory weights .* has no memory"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "adapter-base")
    with pytest.raises(TngramError, match="holds n-gram memory weights .* has no memory"):
        peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter-base")


def test_saving_an_adapter_prints_no_model_type_warning(tmp_path, capfd, caplog):
    """peft reads its base's config.json on every save through the model's config class; the
    memory config class reads a family folder as its own (the same network) where transformers
    warned "You are using a model of type `llama` to instantiate a model of type `tngram_llama`"."""
    from transformers import AutoModelForCausalLM

    from hf_tiny import MEMORIES, tiny_model
    from tngram.hf import add_memory

    tiny_model("llama").save_pretrained(tmp_path / "base")
    model = add_memory(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), MEMORIES["engram"])
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                    modules_to_save=["ngram_memory"]))
    capfd.readouterr()
    pm.save_pretrained(tmp_path / "adapter")
    type(model.config).from_pretrained(tmp_path / "base")  # what peft calls
    out = capfd.readouterr()
    said = out.err + out.out + " ".join(r.getMessage() for r in caplog.records)
    assert "You are using a model of type" not in said


def shared_memory(kind: str):
    """Memories whose layers share one table (the first layer's module owns it)."""
    from tngram.memory.product_key import ProductKeyConfig
    from tngram.memory.tngram_variants import TNGramVariantConfig

    if kind == "share_factors":
        return TNGramVariantConfig(max_ngram=3, cp_rank=8, zero_init_value=False,
                                   zero_init_conv=False, share_factors=True)
    return ProductKeyConfig(n_keys=8, key_dim=16, topk=2, shared_values=True)


@pytest.mark.parametrize("kind", ["share_factors", "shared_values"])
def test_shared_tables_stay_shared_through_modules_to_save(tmp_path, kind):
    """peft copies each layer's memory on its own (modules_to_save), which gave layer 2 a private
    copy of layer 0's table, never trained nor saved. The hooks point layer 2's running copy at
    layer 0's: training moves the one table both read, and the adapter reloaded, the merged
    model and the merged model saved and loaded compute the trained model's logits."""
    from transformers import AutoModelForCausalLM

    from hf_tiny import tiny_model
    from tngram.hf import add_memory
    from tngram.hf.hooks import owner_refs

    tiny_model("llama").save_pretrained(tmp_path / "base")

    def with_shared():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        return add_memory(base, shared_memory(kind), layers=(0, 2), memory_seed=1)

    model = with_shared()
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                    modules_to_save=["ngram_memory"]))
    x = prompt(2, 12, seed=5)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    pm.train()
    for _ in range(3):
        pm(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    pm.eval()
    layers = pm.base_model.model.model.layers
    first, second = (layers[i].ngram_memory.modules_to_save["default"] for i in (0, 2))
    (src,) = owner_refs(second).values()
    assert src is first  # layer 2 reads the table layer 0's copy trains
    original = layers[0].ngram_memory.original_module
    table = "factors" if kind == "share_factors" else "values"
    assert not torch.equal(getattr(first, table), getattr(original, table))  # it trained
    with torch.no_grad():
        want = pm(x).logits
    pm.save_pretrained(tmp_path / "adapter")
    again = peft.PeftModel.from_pretrained(with_shared(), tmp_path / "adapter").eval()
    merged = copy.deepcopy(pm).merge_and_unload().eval()
    merged.save_pretrained(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, want)
        torch.testing.assert_close(merged(x).logits, want, rtol=0, atol=1e-6)  # LoRA merged
        assert torch.equal(loaded(x).logits, merged(x).logits)


def test_save_memory_from_a_peft_model_keeps_the_trained_copy(tmp_path):
    """save_memory(peft_model) writes the memory's modules_to_save copy (the one that trains),
    so the base with load_memory equals the PeftModel with its LoRA at zero."""
    from tngram.hf import load_memory, save_memory

    from hf_tiny import tiny_model

    pm = memory_adapter()
    for m in pm.modules():
        if hasattr(m, "lora_B"):
            torch.nn.init.zeros_(m.lora_B["default"].weight)
    save_memory(pm, tmp_path / "mem")
    base = load_memory(tiny_model("llama"), tmp_path / "mem")
    x = prompt(2, 9)
    with torch.no_grad():
        assert torch.equal(base(x).logits, pm(x).logits)


def test_memory_optimizer_groups_the_trained_copy_of_a_peft_model(tmp_path):
    """Under modules_to_save the memory that trains is peft's copy: its tables get the table
    group (no decay), the frozen original none."""
    from tngram.hf import memory_optimizer

    pm = memory_adapter("engram")
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], weight_decay=0.1)
    groups = {
        g["group"]: {id(p) for p in g["params"]}
        for g in memory_optimizer(pm, args, 0.1).param_groups
    }
    trained = [
        p
        for n, p in pm.named_parameters()
        if n.endswith("ngram_memory.modules_to_save.default.table.weight")
    ]
    assert len(trained) == 2 and {id(p) for p in trained} == groups["memory_table"]
    for name, p in pm.named_parameters():
        if "original_module" in name:
            assert not any(id(p) in g for g in groups.values())

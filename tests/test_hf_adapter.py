"""The memory as an adapter (tngram.hf.adapter): save_memory writes only the memory and the
base's identity, load_memory puts it onto the same base (exactly the saved model) and refuses
another one; trainable="memory" freezes the backbone; the parameter report counts by hand;
disable_memory gives the plain model's numbers; remove_memory gives back the family class."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import MEMORIES, prompt, tiny_config, tiny_model, with_memory
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from tngram.common import TngramError
from tngram.hf import (
    add_memory,
    disable_memory,
    load_memory,
    memory_modules,
    print_trainable_parameters,
    remove_memory,
    save_memory,
    trainable_parameters,
)
from tngram.hf.adapter import SPEC_FILE, WEIGHTS_FILE


@pytest.mark.parametrize("kind", ["tngram", "engram", "oe"])
def test_save_memory_then_load_onto_the_same_base_is_exact(tmp_path, kind):
    """The base comes back through save_pretrained / from_pretrained (another name_or_path,
    a loaded config): the identity still matches and the logits equal the saved model's."""
    model = with_memory("llama", kind)
    x = prompt(2, 9)
    save_memory(model, tmp_path / "mem")
    tiny_model("llama").save_pretrained(tmp_path / "base")  # the same seed: the same weights
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    load_memory(base, tmp_path / "mem")
    with torch.no_grad():
        assert torch.equal(base(x).logits, model(x).logits)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(base.generate(x, **kw), model.generate(x, **kw))
    assert type(base).__name__ == "TngramLlamaForCausalLM"


def test_saved_file_holds_only_the_memory(tmp_path):
    from safetensors.torch import load_file

    model = with_memory("llama", "tngram")
    save_memory(model, tmp_path / "mem")
    tensors = load_file(tmp_path / "mem" / WEIGHTS_FILE)
    want = {k for k in model.state_dict() if ".ngram_memory." in k}
    assert set(tensors) == want
    meta = json.loads((tmp_path / "mem" / SPEC_FILE).read_text())
    assert meta["spec"] == model.config.tngram_memory
    assert meta["base"]["vocab_size"] == model.get_input_embeddings().num_embeddings
    assert meta["base"]["model_type"] == "llama" and len(meta["base"]["config_hash"]) == 64
    with pytest.raises(TngramError, match="exists; save to a new directory"):
        save_memory(model, tmp_path / "mem")
    save_memory(model, tmp_path / "mem", overwrite=True)


@pytest.mark.parametrize(
    "other",
    [
        lambda: tiny_model("qwen2"),  # another family
        lambda: LlamaForCausalLM(
            tiny_config("llama").__class__(  # another width
                **{**tiny_config("llama").to_dict(), "hidden_size": 48, "model_type": "llama"}
            )
        ),
        lambda: LlamaForCausalLM(
            tiny_config("llama").__class__(  # another vocabulary
                **{**tiny_config("llama").to_dict(), "vocab_size": 67, "model_type": "llama"}
            )
        ),
    ],
)
def test_load_memory_refuses_another_base(tmp_path, other):
    save_memory(with_memory("llama", "tngram"), tmp_path / "mem")
    base = other()
    cls = type(base)
    with pytest.raises(TngramError, match="saved from a different base"):
        load_memory(base, tmp_path / "mem")
    assert type(base) is cls and not memory_modules(base)


def _llama(**changes):
    cfg = tiny_config("llama")
    torch.manual_seed(0)  # the weights of tiny_model("llama")
    return LlamaForCausalLM(cfg.__class__(**{**cfg.to_dict(), **changes})).eval()


def test_load_memory_ignores_token_ids_and_names_the_field_that_differs(tmp_path):
    """Recipes set pad / eos / bos token ids freely: they do not change the network, so a base
    differing only there takes the memory, exactly. A field that does change it is named with
    both values, and ignore_base_fields lets a user vouch for it."""
    model = with_memory("llama", "tngram")
    x = prompt(2, 9)
    save_memory(model, tmp_path / "mem")
    meta = json.loads((tmp_path / "mem" / SPEC_FILE).read_text())
    assert meta["base"]["config"]["hidden_size"] == 32 and "pad_token_id" not in str(meta)
    base = load_memory(_llama(pad_token_id=5, eos_token_id=7, bos_token_id=3), tmp_path / "mem")
    with torch.no_grad():
        assert torch.equal(base(x).logits, model(x).logits)
    other = _llama(rms_norm_eps=1e-3)
    with pytest.raises(TngramError, match=r"config\.rms_norm_eps is 1e-06 there, 0\.001 here.*"
                                          r"ignore_base_fields=\['rms_norm_eps'\]"):
        load_memory(other, tmp_path / "mem")
    assert type(other) is LlamaForCausalLM and not memory_modules(other)
    load_memory(other, tmp_path / "mem", ignore_base_fields=["rms_norm_eps"])
    assert memory_modules(other)
    with pytest.raises(TngramError, match=r"config\.num_hidden_layers is 3 there, 4 here"):
        load_memory(_llama(num_hidden_layers=4), tmp_path / "mem")


def test_load_memory_reads_files_without_a_field_record(tmp_path):
    """A tngram_memory.json written before base.config was recorded: its config_hash (over every
    field but the runtime ones, token ids included) still admits the same base."""
    from tngram.hf.adapter import _LEGACY_RUNTIME_FIELDS, _sha256_json

    model = with_memory("llama", "tngram")
    save_memory(model, tmp_path / "mem")
    path = tmp_path / "mem" / SPEC_FILE
    meta = json.loads(path.read_text())
    del meta["base"]["config"]
    legacy = {k: v for k, v in tiny_config("llama").to_dict().items()
              if k not in _LEGACY_RUNTIME_FIELDS}
    meta["base"]["config_hash"] = _sha256_json(legacy)
    path.write_text(json.dumps(meta))
    x = prompt(2, 9)
    with torch.no_grad():
        assert torch.equal(load_memory(tiny_model("llama"), tmp_path / "mem")(x).logits,
                           model(x).logits)
    with pytest.raises(TngramError, match="config_hash is .*this file records no config fields"):
        load_memory(_llama(rms_norm_eps=1e-3), tmp_path / "mem")


def test_load_memory_refuses_edited_weights_and_a_model_with_memory(tmp_path):
    from safetensors.torch import load_file, save_file

    save_memory(with_memory("llama", "tngram"), tmp_path / "mem")
    with pytest.raises(TngramError, match="already has an n-gram memory"):
        load_memory(with_memory("llama", "engram"), tmp_path / "mem")
    tensors = load_file(tmp_path / "mem" / WEIGHTS_FILE)
    tensors.pop(sorted(tensors)[0])
    save_file(tensors, tmp_path / "mem" / WEIGHTS_FILE)
    base = tiny_model("llama")
    with pytest.raises(TngramError, match="tensors do not match what the model needs"):
        load_memory(base, tmp_path / "mem")
    assert type(base) is LlamaForCausalLM and not memory_modules(base)  # left as it was


def _step(model):
    """One SGD step on every parameter that requires grad."""
    x = prompt(2, 9)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def test_save_memory_refuses_a_backbone_that_changed(tmp_path):
    """add_memory's default trainable="all" trains the backbone too, and save_memory writes the
    memory alone: on the base it then gave other logits, silently. A backbone an optimiser
    changed since the memory was added is refused, naming a parameter; a frozen backbone, a
    PeftModel's, the same weights loaded again, a deepcopy and a model from from_pretrained
    save as before."""
    import copy

    model = with_memory("llama", "engram")
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # written in place, the same values
    save_memory(copy.deepcopy(model), tmp_path / "copy")
    model.save_pretrained(tmp_path / "full")
    save_memory(AutoModelForCausalLM.from_pretrained(tmp_path / "full"), tmp_path / "loaded")
    _step(model)
    with pytest.raises(TngramError, match=r"backbone changed since the memory was added \(model\."
                                          r".*trainable='all'.*save_pretrained"):
        save_memory(model, tmp_path / "trained")
    with pytest.raises(TngramError, match="backbone changed"):
        save_memory(copy.deepcopy(model), tmp_path / "trained")
    frozen = add_memory(tiny_model("llama"), MEMORIES["engram"], layers=(0, 2), memory_seed=1,
                        trainable="memory")
    _step(frozen)
    save_memory(frozen, tmp_path / "memory-only")
    x = prompt(2, 9)
    with torch.no_grad():
        again = load_memory(tiny_model("llama"), tmp_path / "memory-only")
        assert torch.equal(again(x).logits, frozen(x).logits)
    peft = pytest.importorskip("peft", reason="peft is not installed (the hf extra has it)")
    pm = peft.get_peft_model(with_memory("llama", "engram"), peft.LoraConfig(
        r=2, target_modules=["q_proj"], modules_to_save=["ngram_memory"], init_lora_weights=False))
    _step(pm)
    save_memory(pm, tmp_path / "peft")  # the LoRA stays apart (documented), the base unchanged


def test_trainable_memory_and_the_report(capsys):
    model = add_memory(tiny_model("llama"), MEMORIES["tngram"], layers=(0, 2), trainable="memory")
    mem = {id(p): p for m in memory_modules(model).values() for p in m.parameters()}
    n_mem = sum(p.numel() for p in mem.values())
    n_all = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert all(p.requires_grad == (id(p) in mem) for p in model.parameters())
    assert trainable_parameters(model) == {
        "trainable": n_mem,
        "all": n_all,
        "memory": n_mem,
        "memory_trainable": n_mem,
    }
    line = print_trainable_parameters(model)
    assert f"trainable params: {n_mem:,}" in capsys.readouterr().out
    assert f"all params: {n_all:,}" in line and f"{100 * n_mem / n_all:.4f}" in line
    with pytest.raises(TngramError, match="trainable must be one of"):
        add_memory(tiny_model("llama"), MEMORIES["tngram"], trainable="backbone")


def test_report_counts_the_memory_of_a_peft_model_once():
    """peft keeps a frozen original beside the copy of the memory it trains (modules_to_save):
    the report counts the copy that runs, so the memory equals the memory of the model before
    wrapping (it was counted twice); switching the adapters off counts the original instead."""
    peft = pytest.importorskip("peft", reason="peft is not installed (the hf extra has it)")
    model = with_memory("llama", "tngram")
    before = trainable_parameters(model)
    pm = peft.get_peft_model(model, peft.LoraConfig(
        r=2, target_modules=["q_proj"], modules_to_save=["ngram_memory"]))
    lora = sum(p.numel() for n, p in pm.named_parameters() if "lora_" in n)
    c = trainable_parameters(pm)
    assert c["memory"] == c["memory_trainable"] == before["memory"]
    assert c["all"] == before["all"] + lora and c["trainable"] == before["memory"] + lora
    with pm.disable_adapter():
        assert trainable_parameters(pm)["memory"] == before["memory"]


def test_disable_memory_gives_the_plain_model():
    model, plain = with_memory("llama", "tngram"), tiny_model("llama")
    x = prompt(2, 9)
    with torch.no_grad():
        with_mem = model(x).logits
        with disable_memory(model):
            assert torch.equal(model(x).logits, plain(x).logits)
            cache = model(x, use_cache=True).past_key_values
        assert torch.equal(model(x).logits, with_mem)  # back on after the block
        assert not torch.equal(with_mem, plain(x).logits)  # the memory does change them
        with pytest.raises(TngramError, match="memory state holds"):
            model(x[:, :1], past_key_values=cache)


def test_remove_memory_gives_back_the_family_model():
    model = with_memory("llama", "engram")
    remove_memory(model)
    x = prompt(2, 9)
    assert type(model) is LlamaForCausalLM and not memory_modules(model)
    with torch.no_grad():
        assert torch.equal(model(x).logits, tiny_model("llama")(x).logits)

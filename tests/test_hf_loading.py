"""Loading saved models with a memory as people do: nested families (OPT) round-trip, a process
without tngram refuses the folder loudly, the spec lives on model.config, and a saved spec that
does not match its weights (wrong types, other layers, duplicates, another Engram seed) is refused
with one line before the model runs on uninitialised memory. Families whose decoder layers are
`base_model.layers` need no layers_attr."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import MEMORIES, VOCAB, prompt, with_memory  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tngram.common import TngramError  # noqa: E402
from tngram.hf import add_memory, memory_spec  # noqa: E402


def tiny_opt():
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                 num_attention_heads=4, word_embed_proj_dim=32,
                                 max_position_embeddings=128, pad_token_id=0, bos_token_id=None,
                                 eos_token_id=None)
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(cfg).eval()


def round_trip(model, path, x):
    with torch.no_grad():
        before = model(x).logits
    model.save_pretrained(path)
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, before)
        assert torch.equal(loaded.generate(x, max_new_tokens=5, do_sample=False),
                           loaded.generate(x, max_new_tokens=5, do_sample=False, use_cache=False))
    return loaded


@pytest.mark.parametrize("kind", ["tngram", "oe"])
def test_nested_family_opt_round_trip(tmp_path, kind):
    """OPTForCausalLM -> OPTModel -> OPTDecoder (a PreTrainedModel too): the memory belongs to
    the outermost model, so from_pretrained no longer tries to attach it to the decoder."""
    model = add_memory(tiny_opt(), MEMORIES[kind], layers=(1,), layers_attr="decoder.layers",
                       memory_seed=3)
    loaded = round_trip(model, tmp_path, prompt(2, 7))
    assert type(loaded).__name__ == "TngramOPTForCausalLM"
    assert memory_spec(loaded) == memory_spec(model) and loaded.config.model_type == "tngram_opt"
    assert type(loaded.model.decoder).__name__ == "OPTDecoder"   # nested model untouched


def test_mistral_round_trip_and_spec_on_config(tmp_path):
    model = with_memory("mistral", "tngram")
    loaded = round_trip(model, tmp_path / "m", prompt(2, 7))
    assert loaded.config.tngram_memory == memory_spec(model)
    # the config alone carries the spec: saved and loaded without the model
    loaded.config.save_pretrained(tmp_path / "c")
    cfg = AutoConfig.from_pretrained(tmp_path / "c")
    assert cfg.model_type == "tngram_mistral" and cfg.tngram_memory == memory_spec(model)
    again = AutoModelForCausalLM.from_config(cfg)
    assert {n for n, _ in again.named_parameters()} == {n for n, _ in model.named_parameters()}


def test_family_class_refuses_a_memory_folder(tmp_path):
    with_memory("llama", "engram").save_pretrained(tmp_path)
    with pytest.raises(TngramError, match="holds a model with an n-gram memory.*AutoModelForCausalLM"):
        transformers.LlamaForCausalLM.from_pretrained(tmp_path)


def run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


def test_without_import_tngram_loading_fails_loudly(tmp_path):
    model = with_memory("llama", "tngram")
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "tngram_llama"
    script = f"""
import sys
from transformers import AutoConfig, AutoModelForCausalLM, pipeline
assert "tngram" not in sys.modules
for load in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
    try:
        load({str(tmp_path)!r})
    except ValueError as e:
        assert "tngram_llama" in str(e), e
        print("refused", load.__qualname__)
    else:
        raise SystemExit("loaded without tngram")
"""
    r = run(script)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("refused") == 2
    # the same folder in a process that imports tngram.hf (nothing else): same logits
    x = prompt()
    with torch.no_grad():
        torch.save({"x": x, "logits": model(x).logits}, tmp_path / "ref.pt")
    r = run(f"""
import torch, tngram.hf
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}).eval()
ref = torch.load({str(tmp_path / 'ref.pt')!r})
with torch.no_grad():
    assert torch.equal(m(ref["x"]).logits, ref["logits"])
print("ok", m.config.model_type, sorted(m.config.tngram_memory))
""")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok tngram_llama" in r.stdout


# ---- a saved spec that does not match its weights: one line, never uninitialised memory ------

def saved(tmp_path, family="llama", kind="tngram", layers=(0, 2)):
    model = with_memory(family, kind, layers=layers)
    model.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def load_edited(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("edit,match", [
    (lambda s: s["memory"].update(cp_rank=math.nan), r"tngram_memory\.memory\.cp_rank must be an int"),
    (lambda s: s["memory"].update(cp_rank=352.0), r"memory\.cp_rank must be an int"),
    (lambda s: s["memory"].update(cp_rank="352"), r"memory\.cp_rank must be an int"),
    (lambda s: s["memory"].update(kind="bogus"), r"memory\.kind must be one of"),
    (lambda s: s.update(layers=[0, 7]), r"layers \[0, 7\] must be distinct decoder-layer indices in \[-3, 3\)"),
    (lambda s: s.update(layers="02"), r"layers must be a list of decoder-layer indices"),
    (lambda s: s.update(layers=[0, 0]), r"must be distinct"),                     # run twice
    (lambda s: s.update(layers=[0, -1]), r"must be non-negative"),
    (lambda s: s.pop("vocab_size"), r"missing \['vocab_size'\]"),
    (lambda s: s.update(memory_seed=1.5), r"memory_seed must be an int"),
    (lambda s: s.update(vocab_size=62), r"vocab mismatch"),
    (lambda s: s.update(layers=[0, 1]), r"memory weights do not match.*'missing'.*layers\.1\."),
    (lambda s: s.update(layers=[0]), r"memory weights do not match.*'unexpected'.*layers\.2\."),
])
def test_edited_spec_is_refused(tmp_path, edit, match):
    cfg = saved(tmp_path)
    edit(cfg["tngram_memory"])
    with pytest.raises(TngramError, match=match):
        load_edited(tmp_path, cfg)


def test_changed_engram_seed_is_refused(tmp_path):
    """Engram's hash multipliers come from memory.seed: with another seed the same tables would
    be read at other rows. The constants are saved with the weights and checked on load."""
    cfg = saved(tmp_path, kind="engram")
    cfg["tngram_memory"]["memory"]["seed"] = 1
    with pytest.raises(TngramError, match=r"ngram_memory\.multipliers of layer 0 does not match"):
        load_edited(tmp_path, cfg)


def test_missing_weights_never_run(tmp_path):
    """The case that gave NaN logits: a layer list changed to one that was not trained."""
    cfg = saved(tmp_path, kind="engram", layers=(0,))
    cfg["tngram_memory"]["layers"] = [1]
    with pytest.raises(TngramError, match="memory weights do not match"):
        load_edited(tmp_path, cfg)


# ---- families found without layers_attr -------------------------------------------------------

AUTO_FAMILIES = ("qwen3", "mixtral", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo2",
                 "starcoder2", "stablelm", "granite", "cohere", "glm", "smollm3")


def tiny_auto(family: str):
    cfg = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, head_dim=8, pad_token_id=0,
                               bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("family", AUTO_FAMILIES)
def test_families_with_a_layers_list_need_no_layers_attr(family, tmp_path):
    model = add_memory(tiny_auto(family), MEMORIES["engram"], layers=(0, 2), memory_seed=1)
    assert memory_spec(model)["layers_attr"] == "layers"
    assert set(n for n in dict(model.named_modules()) if n.endswith("ngram_memory")) == \
        {"model.layers.0.ngram_memory", "model.layers.2.ngram_memory"}
    x = prompt(2, 5)
    with torch.no_grad():
        cached = model.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        full = model.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False, use_cache=False)
        plain = tiny_auto(family)(x).logits
        assert not torch.equal(model(x).logits, plain)      # the memory is in the forward
    assert torch.equal(cached, full)
    model.save_pretrained(tmp_path)                          # every family the docs name reloads
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.model_type == f"tngram_{family}"
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("family", ["gemma3_text", "mixtral"])
def test_auto_detected_family_round_trip(tmp_path, family):
    model = add_memory(tiny_auto(family), MEMORIES["tngram"], layers=(1,), memory_seed=2)
    round_trip(model, tmp_path, prompt(2, 6))


def test_unknown_layout_still_needs_layers_attr():
    with pytest.raises(TngramError, match="model_type 'opt'.*pass layers_attr="):
        add_memory(tiny_opt(), MEMORIES["tngram"])

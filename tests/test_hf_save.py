"""save_pretrained / from_pretrained round trip: memory spec in config.json, every weight in
safetensors (no pickle), identical logits after AutoModelForCausalLM.from_pretrained; in a fresh
process, `import tngram` changes nothing outside tngram and `import tngram.hf` switches the
integration on (saved models, PEFT adapters with a memory, save_memory folders load)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import VOCAB, prompt, with_memory  # noqa: E402

from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402


@pytest.mark.parametrize("family,kind", [("llama", "tngram"), ("gpt2", "engram"),
                                         ("qwen2", "oe"), ("gpt_neox", "tngram_fused")])
def test_round_trip_identical_logits(tmp_path, family, kind):
    model = with_memory(family, kind)
    x = prompt(2, 9)
    with torch.no_grad():
        before = model(x).logits
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["tngram_memory"]["memory"]["kind"] == kind.split("_")[0]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert any("ngram_memory" in k for k in keys)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:   # buffers included: hash primes / multipliers / moduli must not be garbage
        assert torch.equal(sd[k], sd2[k]), k
    with torch.no_grad():
        after = loaded(x).logits
    assert torch.equal(before, after)
    # generation after loading still uses the cache correctly
    with torch.no_grad():
        a = loaded.generate(x, max_new_tokens=6, do_sample=False)
        b = loaded.generate(x, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(a, b)


def test_base_automodel_gets_the_memory(tmp_path):
    model = with_memory("llama", "tngram")
    model.save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path).eval()
    x = prompt()
    with torch.no_grad():
        h1 = model.model(x).last_hidden_state
        h2 = base(x).last_hidden_state
    assert torch.equal(h1, h2)


def test_fresh_process_import_tngram_hf_then_everything_loads(tmp_path):
    """The path users take, in a new interpreter: `import tngram` leaves sys.meta_path alone and
    imports neither transformers nor peft, so transformers refuses a memory folder as it does
    without tngram; after `import tngram.hf` (peft imported later still gets its check) the
    folder, a PEFT adapter holding the memory, and a save_memory folder load exactly."""
    import peft

    from tngram.hf import save_memory
    from hf_tiny import tiny_model

    model = with_memory("mistral", "engram")
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["ngram_memory"],
                           init_lora_weights=False)
    torch.manual_seed(3)
    pm = peft.get_peft_model(with_memory("mistral", "engram"), lora).eval()
    x = prompt()
    with torch.no_grad():
        ref = {"x": x, "full": model(x).logits, "peft": pm(x).logits}
    torch.save(ref, tmp_path / "ref.pt")
    model.save_pretrained(tmp_path / "m")
    save_memory(model, tmp_path / "mem")
    pm.save_pretrained(tmp_path / "adapter")
    tiny_model("mistral").save_pretrained(tmp_path / "base")
    script = f"""
import sys, torch
before = list(sys.meta_path)
import tngram
assert sys.meta_path == before, "import tngram changed sys.meta_path"
assert not {{"transformers", "peft"}} & set(sys.modules), "import tngram imported transformers"
from transformers import AutoModelForCausalLM, PreTrainedModel
assert not hasattr(PreTrainedModel.from_pretrained, "_tngram_patched")
try:
    AutoModelForCausalLM.from_pretrained({str(tmp_path / "m")!r})
except ValueError as e:
    assert "tngram_mistral" in str(e), e
else:
    raise SystemExit("a memory folder loaded without tngram.hf")
import tngram.hf
import peft
from tngram.common import TngramError
ref = torch.load({str(tmp_path / "ref.pt")!r})
m = AutoModelForCausalLM.from_pretrained({str(tmp_path / "m")!r}).eval()
base = lambda: AutoModelForCausalLM.from_pretrained({str(tmp_path / "base")!r}).eval()
spec = m.config.tngram_memory
mem = tngram.hf.load_memory(base(), {str(tmp_path / "mem")!r}).eval()
from tngram.memory import memory_config_from_dict
with_mem = tngram.hf.add_memory(base(), memory_config_from_dict(spec["memory"]),
                                layers=spec["layers"], memory_seed=spec["memory_seed"])
pm = peft.PeftModel.from_pretrained(with_mem, {str(tmp_path / "adapter")!r}).eval()
with torch.no_grad():
    assert torch.equal(m(ref["x"]).logits, ref["full"])
    assert torch.equal(mem(ref["x"]).logits, ref["full"])
    assert torch.equal(pm(ref["x"]).logits, ref["peft"])
try:
    peft.PeftModel.from_pretrained(base(), {str(tmp_path / "adapter")!r})
except TngramError as e:
    assert "holds n-gram memory weights" in str(e), e
else:
    raise SystemExit("an adapter with memory weights loaded onto a base without the memory")
print("ok", type(m.model.layers[0].ngram_memory).__name__)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ok Engram" in r.stdout

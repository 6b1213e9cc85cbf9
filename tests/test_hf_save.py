"""save_pretrained / from_pretrained round trip: memory spec in config.json, every weight in
safetensors (no pickle), identical logits after AutoModelForCausalLM.from_pretrained, also in a
fresh process that imports tngram before transformers (the import hook path)."""

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


def test_fresh_process_import_tngram_then_transformers(tmp_path):
    model = with_memory("mistral", "engram")
    x = prompt()
    with torch.no_grad():
        expected = model(x).logits
    model.save_pretrained(tmp_path / "m")
    torch.save({"x": x, "logits": expected}, tmp_path / "ref.pt")
    script = f"""
import sys, torch
import tngram
assert "transformers" not in sys.modules, "import tngram imported transformers"
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r}).eval()
ref = torch.load({str(tmp_path / 'ref.pt')!r})
with torch.no_grad():
    out = m(ref["x"]).logits
assert torch.equal(out, ref["logits"]), (out - ref["logits"]).abs().max()
print("ok", type(m.model.layers[0].ngram_memory).__name__)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok Engram" in r.stdout

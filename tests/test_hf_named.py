"""Several named memories on one base (tngram.hf.named): add, switch, disable, save and load
each; a kept memory is outside the model's forward, parameters and state_dict; a cache filled
with one memory running is refused by another."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import MEMORIES, prompt, tiny_model  # noqa: E402

from tngram.common import TngramError  # noqa: E402
from tngram.hf import (  # noqa: E402
    add_memory,
    disable_memory,
    forget_memory,
    keep_memory,
    load_memory,
    memory_names,
    save_memory,
    use_memory,
)


def logits(model, x):
    with torch.no_grad():
        return model(x, use_cache=False).logits


@pytest.fixture
def two(tmp_path):
    """A base with TN-gram kept as "code" and Engram as "math", and the logits of each alone."""
    x = prompt()
    base = logits(tiny_model("llama"), x)
    alone = {}
    for name, kind, layers in (("code", "tngram_fused", (0,)), ("math", "engram", (1, 2))):
        m = add_memory(tiny_model("llama"), MEMORIES[kind], layers=layers, memory_seed=3)
        alone[name] = logits(m, x)
    model = tiny_model("llama")
    add_memory(model, MEMORIES["tngram_fused"], layers=(0,), memory_seed=3)
    keep_memory(model, "code")
    add_memory(model, MEMORIES["engram"], layers=(1, 2), memory_seed=3)
    keep_memory(model, "math")
    return model, x, base, alone


def test_switch_and_disable(two):
    model, x, base, alone = two
    assert memory_names(model) == {"running": None, "kept": ["code", "math"]}
    assert type(model).__name__ == "LlamaForCausalLM"  # both kept: the plain base
    assert torch.equal(logits(model, x), base)
    assert not any("ngram_memory" in k for k in model.state_dict())
    for name in ("code", "math", "code"):
        use_memory(model, name)  # the running one is kept aside first
        assert memory_names(model)["running"] == name
        assert torch.equal(logits(model, x), alone[name])
        with disable_memory(model):
            assert torch.equal(logits(model, x), base)
    assert memory_names(model) == {"running": "code", "kept": ["math"]}
    n_params = sum(p.numel() for p in model.parameters())
    keep_memory(model, "code")
    assert sum(p.numel() for p in model.parameters()) < n_params


def test_save_and_load_each(two, tmp_path):
    model, x, base, alone = two
    for name in ("code", "math"):
        use_memory(model, name)
        save_memory(model, tmp_path / name)
    fresh = tiny_model("llama")
    for name in ("math", "code"):
        load_memory(fresh, tmp_path / name)
        keep_memory(fresh, name)
    for name in ("code", "math"):
        use_memory(fresh, name)
        assert torch.equal(logits(fresh, x), alone[name])


def test_generation_after_a_switch_and_the_old_cache(two):
    model, x, base, alone = two
    use_memory(model, "code")
    with torch.no_grad():
        out = model(x)  # a cache filled with "code" running
        use_memory(model, "math")
        with pytest.raises(TngramError, match="another n-gram memory"):
            model(x[:, :1], past_key_values=out.past_key_values)
        kw = dict(max_new_tokens=6, do_sample=False)
        assert torch.equal(model.generate(x, **kw), model.generate(x, use_cache=False, **kw))


def test_refusals(two):
    model, x, base, alone = two
    with pytest.raises(TngramError, match="no n-gram memory running"):
        keep_memory(model, "other")
    with pytest.raises(TngramError, match="no memory named 'nope'"):
        use_memory(model, "nope")
    add_memory(model, MEMORIES["oe"])
    with pytest.raises(TngramError, match="has no name"):
        use_memory(model, "code")
    with pytest.raises(TngramError, match="kept already"):
        keep_memory(model, "code")
    with pytest.raises(TngramError, match="non-empty str"):
        keep_memory(model, "")
    keep_memory(model, "oe")
    forget_memory(model, "oe")
    with pytest.raises(TngramError, match="no memory named"):
        forget_memory(model, "oe")
    assert memory_names(model) == {"running": None, "kept": ["code", "math"]}

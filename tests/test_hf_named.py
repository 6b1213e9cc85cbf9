"""Several named memories on one base (tngram.hf set_memory / memory_names / name=): add,
switch, disable, save and load each; only the running memory is in forward, parameters() and
state_dict, so an optimiser trains it alone; a cache filled with one memory running is refused by
another."""

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
    load_memory,
    memory_names,
    remove_memory,
    save_memory,
    set_memory,
    set_trainable,
)


def logits(model, x):
    with torch.no_grad():
        return model(x, use_cache=False).logits


@pytest.fixture
def two():
    """A base with TN-gram added as "code" and Engram as "math" ("math" runs), and the logits of
    the base and of each memory added alone to its own copy of the base (the reference)."""
    x = prompt()
    base = logits(tiny_model("llama"), x)
    alone = {}
    for name, kind, layers in (("code", "tngram_fused", (0,)), ("math", "engram", (1, 2))):
        m = add_memory(tiny_model("llama"), MEMORIES[kind], layers=layers, memory_seed=3)
        alone[name] = logits(m, x)
    model = tiny_model("llama")
    add_memory(model, MEMORIES["tngram_fused"], layers=(0,), memory_seed=3, name="code")
    add_memory(model, MEMORIES["engram"], layers=(1, 2), memory_seed=3, name="math")
    return model, x, base, alone


def test_switch_and_disable(two):
    model, x, base, alone = two
    assert memory_names(model) == {"active": "math", "kept": ["code"]}
    assert not torch.equal(alone["code"], alone["math"])  # two different networks
    for name in ("math", "code", "math", "code"):
        set_memory(model, name)
        assert memory_names(model)["active"] == name
        assert torch.equal(logits(model, x), alone[name])
        with disable_memory(model):
            assert torch.equal(logits(model, x), base)
    keys = [k for k in model.state_dict() if "ngram_memory" in k]
    assert keys and all(k.startswith("model.layers.0.") for k in keys)  # "code" alone
    set_memory(model, None)  # none runs: the plain base, both kept
    assert memory_names(model) == {"active": None, "kept": ["code", "math"]}
    assert type(model).__name__ == "LlamaForCausalLM"
    assert torch.equal(logits(model, x), base)
    assert not any("ngram_memory" in k for k in model.state_dict())
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in tiny_model("llama").parameters()
    )


def test_save_and_load_each_by_name(two, tmp_path):
    model, x, base, alone = two
    for name in ("code", "math"):
        set_memory(model, name)
        save_memory(model, tmp_path / name)
    fresh = tiny_model("llama")
    for name in ("math", "code"):
        load_memory(fresh, tmp_path / name, name=name)
    assert memory_names(fresh) == {"active": "code", "kept": ["math"]}
    for name in ("code", "math", "code"):
        set_memory(fresh, name)
        assert torch.equal(logits(fresh, x), alone[name])
    with pytest.raises(TngramError, match="already has an n-gram memory named 'math'"):
        load_memory(fresh, tmp_path / "math", name="math")
    assert memory_names(fresh) == {"active": "code", "kept": ["math"]}  # left as it was


def test_generation_after_a_switch_and_a_stale_cache(two):
    model, x, base, alone = two
    set_memory(model, "code")
    kw = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        out = model(x)  # a cache filled with "code" running
        set_memory(model, "math")
        with pytest.raises(TngramError, match="another n-gram memory"):
            model(x[:, :1], past_key_values=out.past_key_values)
        cached = model.generate(x, **kw)
        assert torch.equal(cached, model.generate(x, use_cache=False, **kw))
        set_memory(model, "code")
        assert torch.equal(model.generate(x, **kw), model.generate(x, use_cache=False, **kw))
        assert not torch.equal(model.generate(x, **kw), cached)  # "code" continues otherwise


def test_training_moves_only_the_running_memory(two):
    model, x, base, alone = two
    set_memory(model, "code")
    set_trainable(model, "memory")  # the backbone frozen; the kept "math" is not listed
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = model(x, labels=x, use_cache=False).loss
    loss.backward()
    opt.step()
    assert not torch.equal(logits(model, x), alone["code"])  # "code" moved
    set_memory(model, "math")
    assert torch.equal(logits(model, x), alone["math"])  # "math" did not
    with disable_memory(model):
        assert torch.equal(logits(model, x), base)  # nor the backbone


def test_the_backbone_record_follows_each_memory(two, tmp_path):
    """Trained with the backbone while "math" runs, the backbone no longer fits "code" either:
    its save is refused, as a save of "math" is."""
    model, x, base, alone = two
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x, labels=x, use_cache=False).loss.backward()
    opt.step()
    set_memory(model, "code")
    with pytest.raises(TngramError, match="backbone changed"):
        save_memory(model, tmp_path / "code")


def test_refusals(two):
    model, x, base, alone = two
    with pytest.raises(TngramError, match="no memory named 'nope'"):
        set_memory(model, "nope")
    with pytest.raises(TngramError, match="already has an n-gram memory named 'code'"):
        add_memory(model, MEMORIES["oe"], name="code")
    with pytest.raises(TngramError, match="non-empty str"):
        add_memory(model, MEMORIES["oe"], name="")
    with disable_memory(model), pytest.raises(TngramError, match="inside a disable_memory"):
        set_memory(model, "code")
    add_memory(model, MEMORIES["oe"], name="oe")
    assert memory_names(model) == {"active": "oe", "kept": ["code", "math"]}
    remove_memory(model, "code")  # a kept one
    remove_memory(model)  # the running one
    assert memory_names(model) == {"active": None, "kept": ["math"]}
    with pytest.raises(TngramError, match="no memory named 'code'"):
        remove_memory(model, "code")

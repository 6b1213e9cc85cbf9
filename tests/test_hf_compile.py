"""torch.compile(fullgraph=True) through the tngram.hf hooks: no graph break in any built-in
family (fullgraph raises on the first one), with and without a padded attention mask, and the
compiled forward (and a training step) computes what the eager one does, with the cache on (the
model's default use_cache=True: the memory's cache is built without a class swap) and in
compiled generation (static cache + compile_config).

The graphs are traced by dynamo and run with the "eager" / "aot_eager" backends: that is where
graph breaks and tracing failures show. Inductor's code generation is not exercised here (35-70 s
per model on the 2-core CI machine; checked by hand, docs/LOG.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import FAMILIES, prompt, with_memory  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


CASES = [(f, "engram") for f in FAMILIES] + [("llama", "oe"), ("gpt2", "tngram")]


@pytest.mark.parametrize("family,kind", CASES)
def test_fullgraph_forward(family, kind):
    model = with_memory(family, kind)
    x = prompt(2, 8)
    mask = torch.ones_like(x)
    mask[1, :3] = 0                                     # left padding in row 1
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        for kw in (dict(), dict(attention_mask=mask)):
            eager = model(x, use_cache=False, **kw).logits
            assert torch.equal(compiled(x, use_cache=False, **kw).logits, eager)


def test_fullgraph_training_step_aot():
    """Forward and backward through AOT autograd: the memory's gradients equal eager ones."""
    model = with_memory("llama", "tngram").train()
    x = prompt(2, 8)
    model(x, labels=x, use_cache=False).loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if "ngram_memory" in n}
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x, labels=x, use_cache=False).loss.backward()
    for n, g in eager.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-5, atol=1e-6)


def test_ids_are_still_checked_outside_compile():
    """The compile-aware check skips the id range only while tracing."""
    from tngram.common import TngramError

    model = with_memory("llama", "engram")
    with pytest.raises(TngramError, match="must lie in"):
        model(torch.tensor([[1, 2, 999]]), use_cache=False)


@pytest.mark.parametrize("kind", ["engram", "oe"])
def test_fullgraph_forward_with_the_cache_on(kind):
    """The default forward (use_cache=True, no cache passed): the memory makes its own cache inside
    the graph; the logits equal eager ones and the returned cache continues decoding exactly."""
    from transformers import DynamicCache

    from tngram.hf.cache_state import memory_cache_class

    model = with_memory("llama", kind)
    x, nxt = prompt(2, 8), prompt(2, 1, seed=9)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = compiled(x)
        assert torch.equal(out.logits, model(x, use_cache=False).logits)
        step = model(nxt, past_key_values=out.past_key_values).logits
        full = model(torch.cat([x, nxt], 1), use_cache=False).logits[:, -1:]
        torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
        mine = memory_cache_class(DynamicCache)(config=model.config)   # a cache made by hand
        assert torch.equal(compiled(x, past_key_values=mine).logits, out.logits)


def test_compiled_generation_static_cache_equals_eager(kind="tngram_fused"):
    """generate(compile_config=...) with a static cache and a left-padded batch: the decode steps
    run compiled (dynamo captured graphs) and the tokens equal eager and uncached generation."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = with_memory("llama", kind)
    x = prompt(2, 8)
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=mask)
    cc = CompileConfig(backend="eager", fullgraph=True)
    cc._compile_all_devices = True          # transformers compiles only on accelerators otherwise
    with torch.no_grad():
        eager = model.generate(x, cache_implementation="static", **kw)
        counters.clear()
        compiled = model.generate(x, cache_implementation="static", compile_config=cc, **kw)
        assert counters["stats"]["unique_graphs"] > 0
        assert torch.equal(compiled, eager)
        assert torch.equal(compiled, model.generate(x, use_cache=False, **kw))

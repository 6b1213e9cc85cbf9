"""A plain transformers cache made by hand and passed to a compiled forward: giving it the memory
state is a class swap dynamo cannot trace. With fullgraph=True compilation stops with dynamo's
graph-break error whose reason is our one line (tngram.hf.cache_state.COMPILED_PLAIN_CACHE);
without fullgraph the swap runs eagerly at that graph break and the call is exact (logits and
the cache it fills, which continues decoding as the eager model's does)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import prompt, with_memory  # noqa: E402

from test_hf_compile import fresh_dynamo  # noqa: E402,F401  (autouse: dynamo reset per test)


def test_fullgraph_with_a_plain_cache_stops_with_our_line():
    from transformers import DynamicCache

    from tngram.hf.cache_state import COMPILED_PLAIN_CACHE, MemoryCacheMixin

    model = with_memory("llama", "engram")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), pytest.raises(Exception) as err:
        compiled(prompt(2, 8), past_key_values=cache)
    assert COMPILED_PLAIN_CACHE in str(err.value)
    assert not isinstance(cache, MemoryCacheMixin)  # nothing ran: the cache is as it was


def test_without_fullgraph_a_plain_cache_works_at_a_graph_break():
    from torch._dynamo.utils import counters
    from transformers import DynamicCache

    model = with_memory("llama", "engram")
    x, nxt = prompt(2, 8), prompt(2, 1, seed=9)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        counters.clear()
        cache = DynamicCache(config=model.config)
        out = compiled(x, past_key_values=cache)
        assert counters["stats"]["unique_graphs"] > 0  # it did compile (around the break)
        assert torch.equal(out.logits, model(x, use_cache=False).logits)
        step = model(nxt, past_key_values=cache).logits  # the filled cache decodes on
        eager_cache = DynamicCache(config=model.config)
        model(x, past_key_values=eager_cache)
        assert torch.equal(step, model(nxt, past_key_values=eager_cache).logits)

"""Incremental decoding (attention KV cache + memory n-gram window + conv state) equals full
recomputation, for the raw GPT and each memory."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from test_gpt import TINY, tiny_memories
from tngram.eval.sample import generate
from tngram.model.gpt import GPT


def model_with(kind):
    mem = None if kind is None else tiny_memories()[kind]
    torch.manual_seed(0)
    m = GPT(replace(TINY, memory=mem))
    for p in m.parameters():  # non-trivial attention/MLP outputs
        if p.dim() == 2 and p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.05)
    return m.eval()


@pytest.mark.parametrize("kind", [None, "tngram", "engram", "oe"])
def test_incremental_logits_equal_full_recomputation(kind):
    m = model_with(kind)
    ids = torch.randint(1, 50, (2, 23))
    with torch.no_grad():
        full = m(ids)
        cache = {}
        chunks = [(0, 6), (6, 7), (7, 8), (8, 15), (15, 16), (16, 23)]   # mixed prefill/step sizes
        inc = torch.cat([m(ids[:, a:b], cache=cache) for a, b in chunks], dim=1)
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)
    assert cache["pos"] == 23


def test_generate_with_cache_equals_without():
    m = model_with("tngram")
    a = generate(m, [1, 5, 7], max_new_tokens=12, temperature=0.8, top_k=10, seed=3)
    b = generate(m, [1, 5, 7], max_new_tokens=12, temperature=0.8, top_k=10, seed=3, use_cache=False)
    assert a == b and len(a) == 12
    greedy = generate(m, [1, 5, 7], max_new_tokens=5, temperature=0)
    with torch.no_grad():  # greedy's first token is the argmax of the full forward
        assert greedy[0] == int(m(torch.tensor([[1, 5, 7]]))[0, -1].argmax())


def test_cache_respects_sequence_len():
    from tngram.common import TngramError
    m = model_with(None)
    with pytest.raises(TngramError, match="sequence_len"):
        generate(m, [1] * 30, max_new_tokens=5)

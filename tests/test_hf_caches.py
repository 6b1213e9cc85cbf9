"""generate() with every cache implementation transformers offers on this machine, with and
without padding, in every built-in family: the output equals full recomputation
(use_cache=False). transformers drops an all-ones attention mask before building the 4-D mask
of a static cache, so "no 2-D mask" must mean "no padding" (it raised before)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import FAMILIES, prompt, with_memory  # noqa: E402

NEW = 6
CACHES = ("static", "sliding_window")   # "dynamic": tests/test_hf_generate.py


def gen(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kw)


def padded_batch():
    long, short = prompt(1, 7, seed=2)[0], prompt(1, 4, seed=3)[0]
    ids = torch.stack([long, torch.cat([torch.zeros(3, dtype=torch.long), short])])
    mask = torch.stack([torch.ones(7), torch.cat([torch.zeros(3), torch.ones(4)])]).long()
    return ids, mask, short


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", CACHES)
def test_cache_implementations_with_and_without_padding(family, cache):
    model = with_memory(family, "engram")
    x = prompt(2, 6)
    full = gen(model, x, use_cache=False)
    # no mask, an explicit all-ones mask (dropped by transformers), and a real padded batch
    assert torch.equal(gen(model, x, cache_implementation=cache), full)
    assert torch.equal(gen(model, x, attention_mask=torch.ones_like(x), cache_implementation=cache), full)
    ids, mask, short = padded_batch()
    batch = gen(model, ids, attention_mask=mask, cache_implementation=cache)
    assert torch.equal(batch, gen(model, ids, attention_mask=mask, use_cache=False))
    # the padded row generates what it generates alone (the pads reach neither window nor conv)
    assert torch.equal(batch[1, 7:], gen(model, short[None], use_cache=False)[0, 4:])


@pytest.mark.parametrize("kind", ["tngram", "oe"])
def test_static_cache_other_memories(kind):
    model = with_memory("qwen2", kind)
    x = prompt(2, 6)
    assert torch.equal(gen(model, x, cache_implementation="static"), gen(model, x, use_cache=False))


def test_a_four_d_mask_without_generate_means_no_padding():
    """Calling the model with a 4-D mask outside generate(): no 2-D mask, so no padding; the
    logits equal those of the same call with the 2-D all-ones mask."""
    model = with_memory("llama", "tngram")
    x = prompt(2, 5)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    with torch.no_grad():
        a = model(x, attention_mask=causal, use_cache=False).logits
        b = model(x, attention_mask=torch.ones_like(x), use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="offloaded caches need CUDA in transformers (cuda streams)")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["offloaded", "offloaded_static"])
def test_offloaded_caches(family, cache):
    model = with_memory(family, "engram").cuda()
    x = prompt(2, 6).cuda()
    assert torch.equal(gen(model, x, cache_implementation=cache), gen(model, x, use_cache=False))
    ids, mask, _ = padded_batch()
    ids, mask = ids.cuda(), mask.cuda()
    assert torch.equal(gen(model, ids, attention_mask=mask, cache_implementation=cache),
                       gen(model, ids, attention_mask=mask, use_cache=False))

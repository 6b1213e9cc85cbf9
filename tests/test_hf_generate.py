"""generate() with the KV cache equals full recomputation (use_cache=False) with a memory in
every supported family: greedy, sampling with a fixed seed, beam search, a left-padded batch
(a padded row generates exactly what it generates alone), and cache cropping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import FAMILIES, VOCAB, prompt, tiny_model, with_memory  # noqa: E402

NEW = 10


def gen(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["tngram", "engram"])
def test_greedy_cached_equals_recomputed(family, kind):
    model = with_memory(family, kind)
    x = prompt()
    cached = gen(model, x, do_sample=False, use_cache=True)
    full = gen(model, x, do_sample=False, use_cache=False)
    assert torch.equal(cached, full)
    # the memory matters: the same backbone without it decodes something else
    plain = gen(tiny_model(family), x, do_sample=False, use_cache=True)
    assert not torch.equal(plain, cached)


@pytest.mark.parametrize("kind", ["tngram", "engram", "oe"])
def test_prefill_with_and_without_a_cache_is_exact(kind):
    """The prompt's logits with a cache (the memory keeps its decode state) equal those without,
    bit for bit, at a width where matmuls round by shape and layout (256: a strided view of the
    memory vector gave Engram's prefill 6e-7 of difference) and at lengths on both sides of the
    fused K/V path's 64 rows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tngram.hf import add_memory
    from tngram.memory.engram import EngramConfig
    from tngram.memory.overencoding import OverEncodingConfig
    from tngram.memory.tngram import TNGramConfig

    memory = {
        "tngram": TNGramConfig(max_ngram=3, cp_rank=64, zero_init_value=False,
                               zero_init_conv=False),
        "engram": EngramConfig(max_ngram=3, n_head_per_ngram=4, n_embed_per_ngram=128, pad_id=0,
                               zero_init_value=False, zero_init_conv=False),
        "oe": OverEncodingConfig(max_ngram=3, zero_init_proj=False),
    }[kind]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    model = add_memory(LlamaForCausalLM(cfg).eval(), memory, layers=(0, 1))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for length in (5, 33, 65):
            x = torch.randint(1, 512, (2, length), generator=g)
            assert torch.equal(model(x).logits, model(x, use_cache=False).logits), length


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", ["oe", "tngram_fused"])
def test_greedy_other_memories(family, kind):
    model = with_memory(family, kind)
    x = prompt()
    cached = gen(model, x, do_sample=False, use_cache=True)
    assert torch.equal(cached, gen(model, x, do_sample=False, use_cache=False))
    assert not torch.equal(cached, gen(tiny_model(family), x, do_sample=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_fixed_seed(family):
    model = with_memory(family, "tngram")
    x = prompt()
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        outs.append(gen(model, x, do_sample=True, top_k=0, temperature=1.0, use_cache=use_cache))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search(family):
    """Beam reordering must reach the memory state: with the wrong rows the cached beams
    diverge from recomputation."""
    model = with_memory(family, "tngram")
    x = prompt(batch=2)
    kw = dict(do_sample=False, num_beams=3, num_return_sequences=2)
    assert torch.equal(gen(model, x, use_cache=True, **kw), gen(model, x, use_cache=False, **kw))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["tngram", "engram"])
def test_left_padded_row_generates_what_it_generates_alone(family, kind):
    model = with_memory(family, kind)
    long, short = prompt(1, 7, seed=2)[0], prompt(1, 4, seed=3)[0]
    pad = torch.zeros(3, dtype=torch.long)                    # pad_token_id 0, left padding
    ids = torch.stack([long, torch.cat([pad, short])])
    mask = torch.stack([torch.ones(7), torch.cat([torch.zeros(3), torch.ones(4)])]).long()
    for kw in (dict(do_sample=False), dict(do_sample=False, num_beams=2)):
        batch = gen(model, ids, attention_mask=mask, **kw)
        alone_long = gen(model, long[None], **kw)
        alone_short = gen(model, short[None], **kw)
        assert torch.equal(batch[0, 7:], alone_long[0, 7:])
        assert torch.equal(batch[1, 7:], alone_short[0, 4:])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_left_padded_over_encoding(family):
    model = with_memory(family, "oe")
    short = prompt(1, 4, seed=3)[0]
    ids = torch.stack([prompt(1, 7, seed=2)[0], torch.cat([torch.zeros(3, dtype=torch.long), short])])
    mask = (torch.arange(7) >= torch.tensor([[0], [3]])).long()
    batch = gen(model, ids, attention_mask=mask, do_sample=False)
    assert torch.equal(batch[1, 7:], gen(model, short[None], do_sample=False)[0, 4:])


def test_continue_from_the_returned_cache():
    """A plain forward creates the cache itself (with the memory state in it); feeding the rest
    with the returned past_key_values equals one full forward."""
    model = with_memory("gpt_neox", "engram")
    x = prompt(2, 11, seed=6)
    with torch.no_grad():
        first = model(x[:, :7])
        rest = model(x[:, 7:], past_key_values=first.past_key_values).logits
        full = model(x, use_cache=False).logits
    torch.testing.assert_close(rest, full[:, 7:], rtol=0, atol=1e-5)


def test_left_padding_matters_for_the_memory(monkeypatch):
    """Negative control: the padded row only matches because of the valid mask. With the mask
    ignored by the memory (pads enter its windows and conv state) the logits move."""
    import tngram.hf.hooks as attach

    model = with_memory("llama", "tngram")
    short = prompt(1, 4, seed=3)
    ids = torch.cat([torch.full((1, 3), 5), short], dim=1)     # pads that are not pad_id
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        alone = model(short).logits[0, -1]
        padded = model(ids, attention_mask=mask).logits[0, -1]
        monkeypatch.setattr(attach, "_valid_mask", lambda *a: None)
        ignored = model(ids, attention_mask=mask).logits[0, -1]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)
    assert (ignored - alone).abs().max() > 1e-3


def test_static_cache_left_padded():
    model = with_memory("llama", "tngram")
    long, short = prompt(1, 7, seed=2)[0], prompt(1, 4, seed=3)[0]
    ids = torch.stack([long, torch.cat([torch.zeros(3, dtype=torch.long), short])])
    mask = (torch.arange(7) >= torch.tensor([[0], [3]])).long()
    batch = gen(model, ids, attention_mask=mask, do_sample=False, cache_implementation="static")
    assert torch.equal(batch[0, 7:], gen(model, long[None], do_sample=False)[0, 7:])
    assert torch.equal(batch[1, 7:], gen(model, short[None], do_sample=False)[0, 4:])


def test_cache_crop_then_continue_equals_full_forward():
    from transformers import DynamicCache

    model = with_memory("llama", "engram")
    x = prompt(2, 12, seed=4)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        model(x[:, :5], past_key_values=cache)
        model(torch.randint(1, VOCAB, (2, 4)), past_key_values=cache)   # a rejected draft
        cache.crop(-4)
        assert cache.get_seq_length() == 5
        tail = model(x[:, 5:], past_key_values=cache).logits
    torch.testing.assert_close(tail, full[:, 5:], rtol=0, atol=1e-5)


def test_prompt_lookup_decoding_uses_crop_and_stays_exact(monkeypatch):
    from tngram.hf.cache_state import MemoryCacheMixin

    crops = []
    orig = MemoryCacheMixin.crop
    monkeypatch.setattr(MemoryCacheMixin, "crop", lambda self, n: (crops.append(n), orig(self, n))[1])
    model = with_memory("llama", "tngram")
    x = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    plain = gen(model, x, do_sample=False)
    assert torch.equal(gen(model, x, do_sample=False, prompt_lookup_num_tokens=3), plain)
    assert any(n < 0 for n in crops), "no draft token was rejected: the test did not crop"


def test_cache_filled_elsewhere_is_refused():
    from tngram.common import TngramError
    from transformers import DynamicCache

    model = with_memory("llama", "tngram")
    plain = tiny_model("llama")
    cache = DynamicCache(config=plain.config)
    with torch.no_grad():
        plain(prompt(), past_key_values=cache)
        with pytest.raises(TngramError, match="cache holds 6 tokens"):
            model(prompt(), past_key_values=cache)


def test_cache_batch_edits_and_copies_follow_the_memory_state():
    """batch_select_indices / batch_repeat_interleave / reset / deepcopy act on the memory
    state too: continuing from an edited cache equals the full forward of the edited batch."""
    import copy

    from transformers import DynamicCache

    model = with_memory("qwen2", "tngram")
    x = prompt(3, 9, seed=5)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(x[:, :6], past_key_values=cache)
        snapshot = copy.deepcopy(cache)                        # prefix caching
        idx = torch.tensor([2, 0])
        cache.batch_select_indices(idx)
        tail = model(x[idx, 6:], past_key_values=cache).logits
        torch.testing.assert_close(tail, model(x[idx]).logits[:, 6:], rtol=0, atol=1e-5)

        snapshot.batch_repeat_interleave(2)
        rep = x.repeat_interleave(2, dim=0)
        tail = model(rep[:, 6:], past_key_values=snapshot).logits
        torch.testing.assert_close(tail, model(rep).logits[:, 6:], rtol=0, atol=1e-5)

        snapshot.reset()
        assert snapshot._tngram_seen == 0 and not snapshot._tngram_memory


def test_gradient_checkpointing_keeps_memory_gradients():
    model = with_memory("llama", "tngram").train()
    x = prompt(2, 8)
    model(x, labels=x).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if "ngram_memory" in n}
    model.zero_grad()
    # activation_checkpointing_enable in recent transformers; gradient_checkpointing_enable before
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model(x, labels=x).loss.backward()
    for n, g in ref.items():
        got = dict(model.named_parameters())[n].grad
        assert got is not None and g.abs().sum() > 0, n
        torch.testing.assert_close(got, g, rtol=1e-4, atol=1e-6)

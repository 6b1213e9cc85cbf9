"""Families whose masks or caches differ from Llama's. Bloom passes generate()'s 2-D padding mask
as long as the whole static cache; the memory reads the call's own columns [past, past + T)
(not the last T), so a left-padded batch with a static cache gives the logits of recomputation in
every family of the suite. Mamba (a cache that is not an attention cache) is refused by
add_memory with one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import FAMILIES, MEMORIES, SPECIAL, VOCAB, prompt, with_memory  # noqa: E402

import transformers  # noqa: E402

from tngram.common import TngramError  # noqa: E402
from tngram.hf import add_memory  # noqa: E402

NEW = 5


def bloom_with_memory():
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4, **SPECIAL)
    model = transformers.BloomForCausalLM(cfg).eval()
    return add_memory(model, MEMORIES["engram"], layers=(0, 2), layers_attr="h", memory_seed=1)


def padded_batch():
    long, short = prompt(1, 7, seed=2)[0], prompt(1, 4, seed=3)[0]
    ids = torch.stack([long, torch.cat([torch.zeros(3, dtype=torch.long), short])])
    mask = torch.stack([torch.ones(7), torch.cat([torch.zeros(3), torch.ones(4)])]).long()
    return ids, mask


def step_logits(model, ids, mask, **kw):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("family", (*FAMILIES, "bloom"))
def test_static_cache_left_padding_logits(family, monkeypatch):
    """Static cache + left-padded batch: every step's logits equal recomputation's; the 2-D
    masks the memory was given are as long as past + T, or (Bloom) as the whole static cache."""
    import tngram.hf.hooks as hooks

    model = bloom_with_memory() if family == "bloom" else with_memory(family, "engram")
    ids, mask = padded_batch()
    seen = []
    orig = hooks._valid_mask

    def spy(m, x, state, past=0):
        two_d = m if isinstance(m, torch.Tensor) and m.dim() == 2 else state.pending_mask
        if two_d is not None:  # a 4-D mask: the 2-D one generate() recorded is read
            seen.append((two_d.shape[1], past, x.shape[1]))
        return orig(m, x, state, past)

    monkeypatch.setattr(hooks, "_valid_mask", spy)
    tokens, logits = step_logits(model, ids, mask, cache_implementation="static")
    assert seen and all(n in (p + t, 7 + NEW - 1) for n, p, t in seen)
    if family == "bloom":
        assert {n for n, _, _ in seen} == {7 + NEW - 1}  # the whole static cache
    want_tokens, want = step_logits(model, ids, mask, use_cache=False)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


def test_bloom_last_columns_would_be_wrong(monkeypatch):
    """Negative control: reading the last T columns of Bloom's cache-long mask (the rule for
    masks of length past + T) moves the logits."""
    import tngram.hf.hooks as hooks

    model = bloom_with_memory()
    ids, mask = padded_batch()
    want = step_logits(model, ids, mask, use_cache=False)[1]
    orig = hooks._valid_mask
    monkeypatch.setattr(
        hooks,
        "_valid_mask",
        lambda m, x, state, past=0: orig(
            m, x, state, m.shape[1] - x.shape[1] if isinstance(m, torch.Tensor) else 0
        ),
    )
    got = step_logits(model, ids, mask, cache_implementation="static")[1]
    assert (got - want).abs().max() > 1e-3


def test_mamba_is_refused_with_one_line():
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=4
    )
    model = transformers.MambaForCausalLM(cfg).eval()
    with pytest.raises(TngramError, match="keeps no attention cache.*not supported"):
        add_memory(model, MEMORIES["tngram"], layers=(0,))
    assert type(model) is transformers.MambaForCausalLM
    assert not any("ngram_memory" in n for n, _ in model.named_modules())

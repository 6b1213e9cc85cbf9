"""A decode step of a memory computes only the new positions (its n-grams from the kept ids, the
conv's new outputs from the kept conv inputs) as the uncached call over the whole sequence
computes them: with a cache, the memory's outputs equal the uncached call's whatever the steps'
lengths and the padding, up to the K/V matmul's rounding by row count (fp32: within 1e-6;
a prefill has the uncached call's rows, so it is bit-identical: tests/test_hf_generate.py); in
generate() with a cache (the path users take) every memory's output at every step equals the
uncached call on the inputs it was given, and the tokens equal generation without a cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import MEMORIES, prompt, with_memory  # noqa: E402

from tngram.hf.classes import MEMORY_ATTR  # noqa: E402


@pytest.mark.parametrize("kind", ["tngram", "tngram_fused", "engram", "oe"])
@pytest.mark.parametrize("keep_history", [True, False])
def test_steps_with_a_cache_equal_the_uncached_call(kind, keep_history):
    """Steps of 5, 1, 3 and 3 positions, rows left-padded by 0, 3 and 5: the steps' outputs,
    concatenated, equal one uncached call over the 12 positions; the first step equals the
    uncached call over its 5 positions bit for bit."""
    torch.manual_seed(0)
    d, V = 32, 61
    m = MEMORIES[kind].build(d_model=d, vocab_size=V).eval()
    g = torch.Generator().manual_seed(1)
    ids, h = torch.randint(1, V, (3, 12), generator=g), torch.randn(3, 12, d, generator=g)
    valid = torch.arange(12) >= torch.tensor([[0], [3], [5]])
    with torch.no_grad():
        full, first = m(h, ids, None, valid), m(h[:, :5], ids[:, :5], None, valid[:, :5])
        cache = {"keep_history": True} if keep_history else {}
        steps = [m(h[:, a:b], ids[:, a:b], cache, valid[:, a:b]) for a, b in
                 ((0, 5), (5, 6), (6, 9), (9, 12))]
    assert torch.equal(steps[0], first)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-6)
    assert full[valid].abs().min() > 0  # the memory's output is not trivially zero


@pytest.mark.parametrize("kind", ["tngram", "tngram_fused", "engram", "oe"])
@pytest.mark.parametrize("num_beams", [1, 2])
def test_generate_with_a_cache_runs_exact_memory_steps(kind, num_beams):
    """generate() with a cache on a left-padded batch: the memories' decode steps (one token
    each) equal the uncached memory call over the whole sequence they were given; the tokens
    equal generation without a cache."""
    model = with_memory("llama", kind)
    mods = [getattr(model.model.layers[i], MEMORY_ATTR, None) for i in (0, 2)]
    mods = [m for m in mods if m is not None] or [getattr(model.model, MEMORY_ATTR)]
    calls: dict[int, list] = {id(m): [] for m in mods}

    def record(mod, args, kwargs, out):  # noqa: ANN001, ANN202
        h, ids = args[:2]
        calls[id(mod)].append((h, ids, kwargs.get("valid"), out, kwargs.get("cache")))

    hooks = [m.register_forward_hook(record, with_kwargs=True) for m in mods]
    x = prompt()
    mask = torch.ones_like(x)
    mask[1, :2] = 0  # row 1 left-padded
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
              num_beams=num_beams)
    with torch.no_grad():
        cached = model.generate(x, **kw)
        for hook in hooks:
            hook.remove()
        assert torch.equal(cached, model.generate(x, use_cache=False, **kw))
        for mod in mods:
            steps = calls[id(mod)]
            assert len(steps) == 6 and all(s[4] is not None for s in steps)
            assert [s[1].shape[1] for s in steps] == [6] + [1] * 5
            if num_beams > 1:
                continue  # beams reorder the rows between steps
            h, ids = torch.cat([s[0] for s in steps], 1), torch.cat([s[1] for s in steps], 1)
            valid = torch.cat([torch.ones_like(s[1], dtype=torch.bool) if s[2] is None else s[2]
                               for s in steps], 1)
            full = mod(h, ids, valid=valid)
            assert torch.equal(steps[0][3], mod(h[:, :6], ids[:, :6], valid=valid[:, :6]))
            torch.testing.assert_close(torch.cat([s[3] for s in steps], 1), full, rtol=0, atol=1e-6)

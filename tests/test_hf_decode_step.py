"""The memory's decode step in one C call (tngram.memory.gating.GatedFusion.c_step): a cached
or uncached call of a few positions without autograd runs the memory's lookup, K/V, gate and
conv in one call instead of ~50 torch ops (docs/HF.md "Generation speed"). These tests check
that generation stays exact with it (with a cache == without, both through the C step), that it
equals the torch ops to fp32 rounding, that it runs where it should and only there, and that a
decode step of a memory dispatches only a handful of torch ops."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from hf_tiny import prompt, with_memory  # noqa: E402

import tngram.memory.gating as gating  # noqa: E402
from tngram.common import TngramError  # noqa: E402
from tngram.kernels.policy import kernel_policy  # noqa: E402
from tngram.memory.engram import EngramConfig  # noqa: E402
from tngram.memory.tngram import TNGramConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not gating.c_step_ready(), reason="no C compiler: torch ops run")

CONFIGS = {
    "tngram": TNGramConfig(max_ngram=4, cp_rank=16, zero_init_value=False, zero_init_conv=False),
    "engram": EngramConfig(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=8, pad_id=0,
                           zero_init_value=False, zero_init_conv=False),
}


@pytest.fixture
def c_calls(monkeypatch):
    """How many memory calls ran the C step."""
    calls = []
    real = gating.c_memory_step

    def spy(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(gating, "c_memory_step", spy)
    return calls


def gen(model, ids, **kw):
    return model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)


def module(kind, d=32, V=100):
    torch.manual_seed(0)
    return CONFIGS[kind].build(d_model=d, vocab_size=V).eval()


@pytest.mark.parametrize("kind", ["tngram", "engram"])
@pytest.mark.parametrize("keep_history", [True, False])
def test_c_step_equals_the_torch_ops(kind, keep_history, c_calls):
    """Decoded 5, 1, 3 and 3 positions at a time with a left-padded row: the C step's outputs
    equal the torch ops' to fp32 rounding, and with a cache they equal the uncached call's
    exactly (both run the C step)."""
    m, g = module(kind), torch.Generator().manual_seed(1)
    ids, h = torch.randint(1, 100, (3, 12), generator=g), torch.randn(3, 12, 32, generator=g)
    valid = torch.arange(12) >= torch.tensor([[0], [3], [5]])
    spans = ((0, 5), (5, 6), (6, 9), (9, 12))
    with torch.no_grad():
        full = m(h, ids, None, valid)
        with kernel_policy(c_step=False):
            torch_full = m(h, ids, None, valid)
        cache = {"keep_history": True} if keep_history else {}
        steps = torch.cat([m(h[:, a:b], ids[:, a:b], cache, valid[:, a:b]) for a, b in spans], 1)
    assert len(c_calls) == 5 and set(c_calls) == {kind}
    assert torch.equal(steps, full)
    torch.testing.assert_close(full, torch_full, rtol=0, atol=1e-6)
    assert not torch.equal(full, torch.zeros_like(full))


@pytest.mark.parametrize("kind", ["tngram_fused", "engram"])
def test_generation_with_the_c_step_is_exact(kind, c_calls):
    """Greedy and beam generation with a cache equal recomputation without one, and the tokens
    equal those of the torch ops; every decode step ran the C step."""
    model = with_memory("llama", kind)
    x = prompt()
    with torch.no_grad():
        cached = gen(model, x, do_sample=False)
        assert len(c_calls) >= 8
        assert torch.equal(cached, gen(model, x, do_sample=False, use_cache=False))
        with kernel_policy(c_step=False):
            assert torch.equal(cached, gen(model, x, do_sample=False))
        beams = gen(model, x, do_sample=False, num_beams=2)
        assert torch.equal(beams, gen(model, x, do_sample=False, num_beams=2, use_cache=False))


def count_ops(fn):
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


@pytest.mark.parametrize("kind", ["tngram", "engram"])
def test_a_decode_step_dispatches_a_handful_of_ops(kind):
    """One decoded token of a memory layer: at most 12 torch ops (the history appends, the
    window, the outputs; the torch ops dispatch about 50)."""
    m = module(kind)
    cache = {"keep_history": True}
    with torch.no_grad():
        m(torch.randn(1, 6, 32), torch.randint(1, 100, (1, 6)), cache)
        step = lambda: m(torch.randn(1, 1, 32), torch.randint(1, 100, (1, 1)), cache)  # noqa: E731
        assert count_ops(step) <= 12
        with kernel_policy(c_step=False):
            assert count_ops(step) > 30


def test_where_the_c_step_does_not_run(c_calls):
    """Autograd, more rows than c_step_max_rows, bf16, several branches, a wrapped projection,
    the policy off: the torch ops run."""
    m = module("tngram")
    x, h = torch.randint(1, 100, (1, 4)), torch.randn(1, 4, 32)
    m(h, x, {})  # parameters require grad: autograd needs the torch ops
    with torch.no_grad():
        m(torch.randn(2, 40, 32), torch.randint(1, 100, (2, 40)))  # 80 rows > 64
        with kernel_policy(c_step=False):
            m(h, x)
        m.to(torch.bfloat16)(h.bfloat16(), x)
        torch.manual_seed(0)
        two = TNGramConfig(max_ngram=3, cp_rank=8, hc_mult=2).build(d_model=32, vocab_size=100)
        two(torch.randn(1, 4, 2, 32), x)
        lora = module("engram")
        lora.fusion.value_proj = torch.nn.Sequential(lora.fusion.value_proj)  # a wrapper
        lora(h, x)
    assert c_calls == []


def test_an_id_outside_the_vocabulary_is_refused():
    m = module("engram")
    with torch.no_grad(), pytest.raises(TngramError, match="must lie in"):
        m(torch.randn(1, 2, 32), torch.tensor([[3, 100]]), {"keep_history": True})

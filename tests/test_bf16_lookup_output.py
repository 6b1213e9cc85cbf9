"""The C lookup's bf16 output and bf16 gradient (used under CPU bf16 autocast) change no number.

Under bf16 autocast the fp32 e is cast to bf16 by the K/V matmul and its gradient comes back in
bf16 and is widened to fp32. The C kernel can write the bf16 e and read the bf16 gradient itself;
these tests compare, bit for bit, against the cast of the fp32 path: the kernel's rounding
(crafted ties, denormals, infinities), the gradients, a TN-gram module and a whole GPT step.
"""

from __future__ import annotations

import pytest
import torch

from tngram.kernels import c_unavailable_reason, kernel_policy, ngram_row_index
from tngram.memory.ngrams import suffix_ngrams
from tngram.memory.tngram import TNGram, TNGramConfig

pytestmark = pytest.mark.skipif(c_unavailable_reason() is not None,
                                reason=f"C kernel unavailable: {c_unavailable_reason()}")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_bf16_rounding_equals_torch_cast_on_crafted_values():
    """N = 2, no norm, no scales, A_2 rows all 1: e = A_1[x_{t-1}] exactly, so any fp32 value
    can be fed through the kernel's rounding: ties (round to even both ways), values just
    above/below a tie, denormals, signed zeros, infinities, the largest finite float."""
    from tngram.kernels.tngram_c import c_lookup_fwd
    special = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -8 + 2 ** -23, 1.0 + 2 ** -8 - 2 ** -23,
               -(1.0 + 2 ** -8), 1e-39, -3e-40, 2 ** -149, 0.0, -0.0, float("inf"), float("-inf"),
               3.4028234663852886e38, 65504.0, 1e-45]
    g = torch.Generator().manual_seed(0)
    vals = torch.cat([torch.tensor(special), torch.randn(4000, generator=g),
                      torch.randn(1000, generator=g) * 1e-38, torch.randn(1000, generator=g) * 1e30])
    R = 64
    rows = vals[: (vals.numel() // R) * R].view(-1, R)                    # (V, R)
    V = rows.shape[0]
    factors = torch.stack([rows, torch.ones(V, R)])                      # A_1 = values, A_2 = 1
    ids = torch.arange(V).view(1, V)                                     # x_{t-1} runs over all rows
    idx = ngram_row_index(suffix_ngrams(ids, 2, 0), V)                   # (V, 2)
    W = torch.ones(1, R)
    e32, _ = c_lookup_fwd(factors, idx, W, None, False, 1e-6, False)
    e16, _ = c_lookup_fwd(factors, idx, W, None, False, 1e-6, True)
    assert e16.dtype == torch.bfloat16
    # e_t = A_1[x_{t-1}]: position 0 reads the pad row (row 0), position t row t-1
    assert torch.equal(e32[1:, 0], rows[:-1])
    assert torch.equal(bits(e16), bits(e32.to(torch.bfloat16)))


@pytest.mark.parametrize("use_norm,with_scales", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("threads", [1, 3])
def test_bf16_output_and_gradient_equal_the_cast_fp32_path(use_norm, with_scales, threads):
    from tngram.kernels.tngram_c import c_lookup_bwd, c_lookup_fwd
    N, V, R = 4, 17, 40
    g = torch.Generator().manual_seed(1)
    factors = torch.randn(N, V, R, generator=g)
    idx = ngram_row_index(suffix_ngrams(torch.randint(0, V, (3, 50), generator=g), N, 0), V)
    W = torch.randn(N - 1, R, generator=g)
    s = torch.rand(N - 1, generator=g) + 0.5 if with_scales else None
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        e32, r32 = c_lookup_fwd(factors, idx, W, s, use_norm, 1e-6, False)
        e16, r16 = c_lookup_fwd(factors, idx, W, s, use_norm, 1e-6, True)
        assert torch.equal(bits(e16), bits(e32.to(torch.bfloat16)))
        assert torch.equal(r16, r32)
        grad16 = torch.randn(e32.shape, generator=g).to(torch.bfloat16)
        got = c_lookup_bwd(grad16, factors, idx, W, s, r32, True, True, True)
        ref = c_lookup_bwd(grad16.float(), factors, idx, W, s, r32, True, True, True)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert got[0].abs().sum() > 0 and got[1].abs().sum() > 0


def _module_run(mod: TNGram, h: torch.Tensor, ids: torch.Tensor, bf16_out: bool):
    mod.zero_grad(set_to_none=True)
    h = h.detach().clone().requires_grad_()
    with kernel_policy(bf16_lookup_output=bf16_out):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(h, ids)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return y.detach(), h.grad, {n: p.grad.clone() for n, p in mod.named_parameters()}


def test_module_under_bf16_autocast_is_bit_identical_and_uses_the_bf16_path(monkeypatch):
    from tngram.kernels import tngram_c
    torch.manual_seed(0)
    mod = TNGram(TNGramConfig(max_ngram=4, cp_rank=24, zero_init_value=False, zero_init_conv=False),
                 d_model=32, vocab_size=29)
    h = torch.randn(2, 70, 32)          # 140 rows: the fused K/V matmul path (>= 64 rows)
    ids = torch.randint(0, 29, (2, 70))
    _module_run(mod, h, ids, False)     # the kernel's first-use self-check runs here, not below
    calls = []
    real = tngram_c.c_lookup_fwd
    monkeypatch.setattr(tngram_c, "c_lookup_fwd",
                        lambda *a: calls.append(a[-1]) or real(*a))
    y1, gh1, gp1 = _module_run(mod, h, ids, True)
    y0, gh0, gp0 = _module_run(mod, h, ids, False)
    assert calls == [True, False]       # the new path ran the bf16 kernel, the old one fp32
    assert y1.dtype == y0.dtype and torch.equal(y1, y0)
    assert torch.equal(gh1, gh0)
    assert gp1.keys() == gp0.keys()
    for n in gp0:
        assert torch.equal(gp1[n], gp0[n]), n
    assert gp1["factors"].abs().sum() > 0


def test_gpt_training_step_under_bf16_autocast_is_bit_identical():
    from tngram.model.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=2, n_kv_head=1, mlp_mult=2,
                    sequence_len=40, memory=TNGramConfig(max_ngram=3, cp_rank=16, zero_init_value=False,
                                                         zero_init_conv=False),
                    memory_layers=(1,))
    torch.manual_seed(3)
    model = GPT(cfg)
    x = torch.randint(1, 64, (2, 40))
    y = torch.randint(1, 64, (2, 40))
    out = {}
    for flag in (True, False):
        model.zero_grad(set_to_none=True)
        with kernel_policy(bf16_lookup_output=flag), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        out[flag] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None})
    assert torch.equal(out[True][0], out[False][0])
    assert out[False][1]["blocks.1.memory.factors"].abs().sum() > 0
    assert out[True][1].keys() == out[False][1].keys()
    for n, g in out[False][1].items():
        assert torch.equal(out[True][1][n], g), n

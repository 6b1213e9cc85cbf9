"""TN-gram: every equation of the paper checked against an independent computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tngram.common import TngramError
from tngram.memory.cp import absorb_f, explicit_f_memory, order_embeddings, order_vectors
from tngram.memory.gating import signed_sqrt_gate
from tngram.memory.ngrams import suffix_ngrams
from tngram.memory.tngram import TNGramConfig

V, R, D = 11, 6, 8


def make(N=4, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = TNGramConfig(max_ngram=N, cp_rank=R, zero_init_value=False, zero_init_conv=False, **kw)
    m = cfg.build(d_model=D, vocab_size=V)
    with torch.no_grad():  # make absorption vectors and scales non-trivial
        if m.absorb is not None:
            m.absorb.copy_(torch.randn_like(m.absorb))
        if m.log_scales is not None:
            m.log_scales.copy_(0.3 * torch.randn_like(m.log_scales))
    return m


def brute_b(m, ids: list[int], t: int, n: int) -> torch.Tensor:
    """Eq. 10 by hand: b_n = w_1..w_{N-n} * A_{N-n+1}[x_{t-n+1}] ... A_N[x_t] (1-based A)."""
    N = m.config.max_ngram
    out = torch.ones(R)
    for j in range(1, N - n + 1):          # w_1 .. w_{N-n}
        out = out * m.absorb[j - 1]
    for i in range(N - n + 1, N + 1):      # factor A_i holds token x_{t-(N-i)}
        pos = t - (N - i)
        tok = ids[pos] if pos >= 0 else m.config.pad_id
        out = out * m.factors[i - 1, tok]
    return out


def test_suffix_ngrams_left_padding_and_order():
    ids = torch.tensor([[5, 6, 7]])
    got = suffix_ngrams(ids, 3, pad_id=9)
    # column k = x_{t-k}: t=0 -> (5, pad, pad); t=2 -> (7, 6, 5)
    assert got.tolist() == [[[5, 9, 9], [6, 5, 9], [7, 6, 5]]]


@pytest.mark.parametrize("N", [2, 3, 5])
def test_eq10_order_vectors_match_brute_force(N):
    m = make(N)
    ids = [3, 1, 4, 1, 5, 9, 2]
    b = order_vectors(m.factors, m.absorb, m.ngrams(torch.tensor([ids])))  # (1, T, N-1, R)
    for t in range(len(ids)):
        for n in range(2, N + 1):
            torch.testing.assert_close(b[0, t, n - 2], brute_b(m, ids, t, n))


def test_eq11_rmsnorm_and_learned_scale():
    m = make(4)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    b = order_vectors(m.factors, m.absorb, m.ngrams(ids))
    e = m.memory_vector(ids).view(1, 5, 3, R)
    for n in range(3):
        bn = b[0, :, n]
        expected = math.exp(m.log_scales[n].item()) * bn / torch.sqrt((bn * bn).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(e[0, :, n], expected)


def test_absorbed_projection_equals_explicit_F_form():
    """k = [e_2 F^T | ... | e_N F^T] W_K equals e_concat M_K with M_{K,n} = F^T W_{K,n} (Eq. 13-14)."""
    torch.manual_seed(1)
    N = 4
    m = make(N, kv_bias=False)
    Fm = torch.randn(D, R)                   # model-dimension factor F (d x R)
    W = torch.randn((N - 1) * D, D)          # W_K stacked over orders ((N-1)d x d)
    # M_n = F^T W_n, built block by block here (independently of absorb_f)
    M = torch.cat([Fm.T @ W[n * D:(n + 1) * D] for n in range(N - 1)], dim=0)
    torch.testing.assert_close(absorb_f(Fm, W, N - 1), M)
    with torch.no_grad():
        m.fusion.key_proj[0].weight.copy_(M.T)
    ids = torch.randint(0, V, (2, 9))
    e_orders = m.memory_vector(ids).view(2, 9, N - 1, R)
    explicit = explicit_f_memory(e_orders, Fm, W)
    absorbed = m.fusion.key_proj[0](m.memory_vector(ids))
    torch.testing.assert_close(absorbed, explicit, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [3, 4, 5])
def test_theorem1_lower_order_is_combination_of_higher_order(n):
    """b_{n-1}(suffix) = sum_x c_x b_n(x, suffix), c from least squares w = A^T c (App. A)."""
    torch.manual_seed(2)
    N, Vbig, Rs = 5, 12, 5                   # V > R so A_{N-n+1} has full column rank
    cfg = TNGramConfig(max_ngram=N, cp_rank=Rs, factor_init="normal")
    m = cfg.build(d_model=D, vocab_size=Vbig).double()
    with torch.no_grad():
        m.absorb.copy_(torch.randn_like(m.absorb))
    A = m.factors[N - n].detach()            # A_{N-n+1} (1-based) = factors[N-n]
    assert torch.linalg.matrix_rank(A) == Rs
    w = m.absorb[N - n].detach()             # w_{N-n+1}
    c = torch.linalg.pinv(A.T) @ w     # (V,): gelsy lstsq can be wrong (pytorch#92537)
    torch.testing.assert_close(A.T @ c, w)
    suffix = [3, 7, 1, 4][: n - 1]           # x_{N-n+2..N}, oldest first
    seqs = torch.tensor([[x] + suffix for x in range(Vbig)])            # every oldest token
    b = order_vectors(m.factors, m.absorb, suffix_ngrams(seqs, N, 0))   # (V, n, N-1, R)
    t = n - 1                                # last position holds the full n-gram
    b_n = b[:, t, n - 2]                     # (V, R): b_n(x, suffix)
    b_lower = b[0, t, n - 3]                 # b_{n-1}(suffix), the same for every x
    torch.testing.assert_close((c.unsqueeze(1) * b_n).sum(0), b_lower)


def test_gate_and_conv_equations():
    """App. D: alpha = RMSNorm(h).RMSNorm(k)/sqrt(d); g = sigmoid(sign sqrt); y = v~ + SiLU(conv(norm v~))."""
    m = make(3, dilation=2)
    with torch.no_grad():
        m.fusion.norm_h.uniform_(0.5, 1.5)
        m.fusion.norm_k.uniform_(0.5, 1.5)
        m.fusion.conv.norm_weight.uniform_(0.5, 1.5)
    B, T = 2, 7
    h = torch.randn(B, T, D)
    ids = torch.randint(0, V, (B, T))
    e = m.memory_vector(ids)
    k = m.fusion.key_proj[0](e)
    v = m.fusion.value_proj(e)
    eps32 = torch.finfo(torch.float32).eps
    rms = lambda x, eps: x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    alpha = (rms(h, eps32) * m.fusion.norm_h[0] * rms(k, eps32) * m.fusion.norm_k[0]).sum(-1, keepdim=True) / math.sqrt(D)
    g = torch.sigmoid(torch.sign(alpha) * torch.sqrt(torch.clamp(alpha.abs(), min=1e-6)))
    vt = g * v
    u = rms(vt, 1e-5) * m.fusion.conv.norm_weight[0]
    conv = torch.nn.Conv1d(D, D, kernel_size=3, groups=D, dilation=2, padding=4, bias=False)
    with torch.no_grad():
        conv.weight.copy_(m.fusion.conv.weight.unsqueeze(1))
    c = conv(u.transpose(1, 2))[..., :T].transpose(1, 2)
    expected = vt + F.silu(c)
    torch.testing.assert_close(m(h, ids), expected, rtol=1e-5, atol=1e-5)


def test_gate_sanity_values():
    # sigmoid(sign(s) sqrt(|s|)): s=0 -> sign 0 -> 0.5; s=1 -> sigmoid(1); s=-4 -> sigmoid(-2)
    s = torch.tensor([0.0, 1.0, -4.0])
    torch.testing.assert_close(signed_sqrt_gate(s), torch.tensor([0.5, 0.7310586, 0.1192029]))


@pytest.mark.parametrize("N", [2, 3, 5])
def test_causality(N):
    m = make(N)
    ids = torch.randint(0, V, (2, 12))
    h = torch.randn(2, 12, D)
    y = m(h, ids)
    ids2, h2 = ids.clone(), h.clone()
    ids2[:, 7:] = (ids2[:, 7:] + 1) % V
    h2[:, 7:] = torch.randn(2, 5, D)
    y2 = m(h2, ids2)
    torch.testing.assert_close(y[:, :7], y2[:, :7], rtol=0, atol=0)
    assert not torch.allclose(y[:, 7:], y2[:, 7:])


@pytest.mark.parametrize("N", range(2, 9))
def test_all_orders_finite_and_b_in_sane_range(N):
    cfg = TNGramConfig(max_ngram=N, cp_rank=64, zero_init_value=False)
    torch.manual_seed(0)
    m = cfg.build(d_model=32, vocab_size=100)
    ids = torch.randint(0, 100, (2, 16))
    b = order_vectors(m.factors, m.absorb, m.ngrams(ids))
    rms = b.pow(2).mean(-1).sqrt()
    # sign init: |entries| = exp(0.1 g) per factor, so the product of n <= 8 factors has
    # log-magnitude std 0.1*sqrt(8) = 0.28 and RMS within a factor ~2 of 1.
    assert rms.min() > 0.5 and rms.max() < 2.0
    y = m(torch.randn(2, 16, 32, requires_grad=True), ids)
    y.square().sum().backward()
    assert torch.isfinite(y).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_gradients_reach_factors_absorption_and_scales():
    m = make(4)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    m(torch.randn(1, 6, D), ids).square().sum().backward()
    assert m.factors.grad.abs().sum() > 0 and m.absorb.grad.abs().sum() > 0
    assert m.log_scales.grad.abs().sum() > 0
    # only rows of tokens that occur (and the pad row, id 0, at the sequence start) get gradient
    touched = m.factors.grad.abs().sum(dim=(0, 2)) > 0
    assert set(torch.nonzero(touched).flatten().tolist()) <= {0, 1, 2, 3, 4, 5, 6}
    assert not touched[7:].any()


def test_ablation_switches_change_exactly_what_they_say():
    full = make(4)
    ids = torch.randint(0, V, (2, 9))
    b = order_vectors(full.factors, full.absorb, full.ngrams(ids))
    names = lambda m: {n for n, _ in m.named_parameters()}
    # without RMSNorm: e_n = s_n b_n, same parameters
    no_norm = make(4, use_norm=False)
    assert names(no_norm) == names(full)
    s = torch.exp(no_norm.log_scales).view(1, 1, 3, 1)
    torch.testing.assert_close(no_norm.memory_vector(ids), (s * b).reshape(2, 9, -1))
    # without learnable scales: no log_scales parameter, e_n = RMSNorm(b_n)
    no_scale = make(4, learn_scales=False)
    assert names(full) - names(no_scale) == {"log_scales"}
    torch.testing.assert_close(no_scale.memory_vector(ids), order_embeddings(b, None))
    # without absorption: no w; lower orders use only their own factors
    no_abs = make(4, use_absorption=False)
    assert names(full) - names(no_abs) == {"absorb"}
    b0 = order_vectors(no_abs.factors, None, no_abs.ngrams(ids))
    seq = ids[0].tolist()
    torch.testing.assert_close(b0[0, 5, 0], no_abs.factors[2, seq[4]] * no_abs.factors[3, seq[5]])
    # both: neither parameter
    both = make(4, learn_scales=False, use_absorption=False)
    assert names(full) - names(both) == {"absorb", "log_scales"}


def test_param_count_formula_matches_module():
    for kw in [{}, {"use_absorption": False}, {"learn_scales": False}, {"kv_bias": False}, {"hc_mult": 2}]:
        cfg = TNGramConfig(max_ngram=5, cp_rank=7, **kw)
        assert cfg.param_count(d_model=16, vocab_size=20) == sum(p.numel() for p in cfg.build(d_model=16, vocab_size=20).parameters())


@pytest.mark.parametrize("kw,msg", [({"max_ngram": 1}, "max_ngram"), ({"cp_rank": 0}, "cp_rank")])
def test_bad_config_errors(kw, msg):
    with pytest.raises(TngramError, match=msg):
        TNGramConfig(**kw).build(d_model=8, vocab_size=10)


def test_bad_token_ids():
    m = make(3)
    h = torch.randn(1, 3, D)
    with pytest.raises(TngramError, match=r"\[0, 11\)"):
        m(h, torch.tensor([[1, 11, 2]]))
    with pytest.raises(TngramError, match="min -1"):
        m(h, torch.tensor([[1, -1, 2]]))


def test_hc_mult_branches_share_value_and_have_own_gates():
    m = make(3, hc_mult=2)
    h = torch.randn(2, 5, 2, D)
    ids = torch.randint(0, V, (2, 5))
    y = m(h, ids)
    assert y.shape == (2, 5, 2, D)
    # swapping the two hidden branches while swapping their key projections and norms swaps outputs
    with torch.no_grad():
        kp = m.fusion.key_proj
        kp[0].weight, kp[1].weight = kp[1].weight, kp[0].weight
        kp[0].bias, kp[1].bias = kp[1].bias, kp[0].bias
        m.fusion.norm_h.copy_(m.fusion.norm_h.flip(0)); m.fusion.norm_k.copy_(m.fusion.norm_k.flip(0))
        m.fusion.conv.norm_weight.copy_(m.fusion.conv.norm_weight.flip(0))
        w = m.fusion.conv.weight.view(2, D, -1).flip(0).reshape(2 * D, -1).clone()
        m.fusion.conv.weight.copy_(w)
    y2 = m(h.flip(2), ids)
    torch.testing.assert_close(y2, y.flip(2), rtol=1e-5, atol=1e-6)

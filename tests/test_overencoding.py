"""Over-Encoding input n-gram embeddings (Huang et al., arXiv 2501.16975).

n-gram ids are checked against Python big-int arithmetic: the full base-V number of the suffix,
reduced once at the end (the module reduces per digit with V^l mod m).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tngram.common import TngramError
from tngram.memory.engram import EngramConfig
from tngram.memory.overencoding import OverEncoding, OverEncodingConfig, oe_moduli


def bigint_ids(seq: list[int], V: int, N: int, k: int, moduli: list[int], pad: int) -> list[list[int]]:
    """Per position t and table s = (i-2)*k + j: (sum_l x_{t-l} V^l over l < i) mod m_s."""
    out = []
    for t in range(len(seq)):
        row = []
        for i in range(2, N + 1):
            number = sum((seq[t - l] if t >= l else pad) * V**l for l in range(i))  # exact
            row += [number % moduli[(i - 2) * k + j] for j in range(k)]
        out.append(row)
    return out


def test_moduli_rules():
    # LongCat-Flash-Lite (§D.2): m = 78 * 131072 = 10,223,616, 12 tables, moduli m + 2i + 1
    assert oe_moduli(78 * 131072, 12, 131072) == [10_223_617 + 2 * i for i in range(12)]
    ms = oe_moduli(5000, 6, 1000)     # V = 1000 = 2^3 5^3: odd, skip multiples of 5
    assert ms == [5001, 5003, 5007, 5009, 5011, 5013]
    for V, rows in [(1000, 5000), (1024, 4096), (999, 1998), (7, 49)]:
        ms = oe_moduli(rows, 5, V)
        assert len(set(ms)) == 5 and all(m >= rows and math.gcd(m, V) == 1 and m % V for m in ms)
    cfg = OverEncodingConfig()
    assert cfg.moduli(1024) == [5121, 5123, 5125, 5127]   # default table_rows 5V = 5120, S = 4


@pytest.mark.parametrize("V,N,k,rows,pad", [(1000, 3, 2, 5000, 0), (1024, 4, 3, 777, 5),
                                             (131072, 4, 1, 1_000_003, 0), (2, 6, 2, 3, 1)])
def test_ngram_ids_match_bigint(V, N, k, rows, pad):
    cfg = OverEncodingConfig(max_ngram=N, n_slices=k, table_rows=rows, pad_id=pad, slice_dim=2)
    m = cfg.build(d_model=4, vocab_size=V)
    rng = random.Random(V)
    seqs = [[rng.randrange(V) for _ in range(10)] for _ in range(3)]
    seqs[1][-4:] = [V - 1] * 4                     # largest digits
    got = m.ngram_ids(torch.tensor(seqs))
    assert got.shape == (3, 10, k * (N - 1))
    assert got.tolist() == [bigint_ids(s, V, N, k, m.moduli.tolist(), pad) for s in seqs]


def test_forward_equals_explicit_sum_of_slice_projections():
    torch.manual_seed(0)
    V, d, N, k = 50, 12, 3, 2
    cfg = OverEncodingConfig(max_ngram=N, n_slices=k, table_rows=61, slice_dim=3,
                             zero_init_proj=False)
    m = cfg.build(d_model=d, vocab_size=V)
    ids = torch.randint(0, V, (2, 7))
    tok = torch.randn(2, 7, d)
    moduli = m.moduli.tolist()
    offs = [sum(moduli[:s]) for s in range(len(moduli))]
    W = m.proj.weight                                   # (d, S*Ds): block s is W_s
    want = tok.clone()
    for b in range(2):
        ngram = bigint_ids(ids[b].tolist(), V, N, k, moduli, 0)
        for t in range(7):
            for s in range(k * (N - 1)):
                row = m.table.weight[offs[s] + ngram[t][s]]           # T_s[id]
                want[b, t] += W[:, 3 * s: 3 * s + 3] @ row            # W_s T_s[id]
    want = want / (1 + k * (N - 1))
    assert torch.allclose(m(tok, ids), want, atol=1e-5)
    m_sum = OverEncodingConfig(max_ngram=N, n_slices=k, table_rows=61, slice_dim=3,
                               average=False).build(d_model=d, vocab_size=V)
    m_sum.load_state_dict(m.state_dict())
    assert torch.allclose(m_sum(tok, ids), want * (1 + k * (N - 1)), atol=1e-5)


def test_zero_init_is_scaled_identity_and_default_widths():
    cfg = OverEncodingConfig()                          # N 3, k 2 -> S = 4, Ds = 512 / 4
    m = cfg.build(d_model=512, vocab_size=1024)
    assert m.slice_dim == 128 and m.n_tables == 4
    tok = torch.randn(2, 5, 512)
    assert torch.equal(m(tok, torch.randint(0, 1024, (2, 5))), tok / 5)


def test_param_count():
    for cfg, d, V in [(OverEncodingConfig(), 512, 1024),
                      (OverEncodingConfig(max_ngram=4, n_slices=3, table_rows=100, slice_dim=5), 16, 33)]:
        m = cfg.build(d_model=d, vocab_size=V)
        assert sum(p.numel() for p in m.parameters()) == cfg.param_count(d_model=d, vocab_size=V)
    # default at d 512, V 1024: rows 5121+5123+5125+5127 = 20,496 of width 128, 4 projections 128x512
    assert OverEncodingConfig().param_count(d_model=512, vocab_size=1024) == 20_496 * 128 + 4 * 128 * 512


def test_causal():
    torch.manual_seed(2)
    cfg = OverEncodingConfig(max_ngram=4, n_slices=2, table_rows=97, zero_init_proj=False)
    m = cfg.build(d_model=24, vocab_size=40)
    ids, tok = torch.randint(0, 40, (2, 10)), torch.randn(2, 10, 24)
    y = m(tok, ids)
    for t in (0, 3, 8):
        ids2, tok2 = ids.clone(), tok.clone()
        ids2[:, t + 1:] = (ids2[:, t + 1:] + 1 + torch.randint(0, 38, (2, 9 - t))) % 40
        tok2[:, t + 1:] = torch.randn_like(tok2[:, t + 1:])
        y2 = m(tok2, ids2)
        assert torch.equal(y[:, : t + 1], y2[:, : t + 1])
        assert not torch.allclose(y[:, t + 1:], y2[:, t + 1:])


def test_gradients_reach_exactly_the_used_rows():
    torch.manual_seed(3)
    V, N, k = 30, 3, 2
    cfg = OverEncodingConfig(max_ngram=N, n_slices=k, table_rows=41, zero_init_proj=False)
    m = cfg.build(d_model=8, vocab_size=V)
    ids = torch.randint(0, V, (2, 5))
    (m(torch.randn(2, 5, 8), ids) ** 2).sum().backward()
    moduli = m.moduli.tolist()
    offs = [sum(moduli[:s]) for s in range(len(moduli))]
    used = {offs[s] + r for seq in ids.tolist() for pos in bigint_ids(seq, V, N, k, moduli, 0)
            for s, r in enumerate(pos)}
    nonzero = set(torch.nonzero(m.table.weight.grad.abs().sum(1)).flatten().tolist())
    assert nonzero == used and len(used) < m.n_rows
    assert m.proj.weight.grad is not None and m.proj.weight.grad.abs().sum() > 0


def test_errors_and_config():
    assert OverEncodingConfig.injection == "embedding" and EngramConfig.injection == "block"
    assert OverEncodingConfig().kind == "oe"
    m = OverEncodingConfig().build(d_model=16, vocab_size=20)
    assert isinstance(m, OverEncoding)
    with pytest.raises(TngramError, match="vocabulary"):
        m(torch.zeros(1, 2, 16), torch.tensor([[0, 20]]))
    with pytest.raises(TngramError, match="vocabulary"):
        m.ngram_ids(torch.tensor([[-1, 2]]))
    with pytest.raises(TngramError, match="tok_emb"):
        m(torch.zeros(1, 3, 16), torch.tensor([[0, 1]]))
    with pytest.raises(TngramError, match="max_ngram"):
        OverEncodingConfig(max_ngram=1)
    with pytest.raises(TngramError, match="n_slices"):
        OverEncodingConfig(n_slices=0)
    with pytest.raises(TngramError, match="pad_id"):
        OverEncodingConfig(pad_id=20).build(d_model=16, vocab_size=20)
    with pytest.raises(TngramError, match="slice"):
        OverEncodingConfig(max_ngram=5, n_slices=4).build(d_model=8, vocab_size=20)     # 8 // 16 = 0
    with pytest.raises(TypeError, match="kind"):
        OverEncodingConfig(kind="engram")    # kind is a class attribute, not a field


@pytest.mark.parametrize("scale", ["mini", "paper-l9"])
def test_longcat_recipe_is_over_encoding_at_longcat_settings_and_tngram_size(scale):
    """`*-oe-longcat`: orders 2..4, 4 slices per order, averaged fusion (LongCat-Flash's n-gram
    embedding), and the slice-table rows chosen so Δparams is within 0.2% of the TN-gram recipe's."""
    from tngram.memory.overencoding import OverEncodingConfig
    from tngram.train.recipes import get_recipe, param_summary
    cfg = get_recipe(f"{scale}-oe-longcat")
    mem = cfg.model.memory
    assert isinstance(mem, OverEncodingConfig)
    assert (mem.max_ngram, mem.n_slices, mem.average) == (4, 4, True)
    assert cfg.model.memory_layers == get_recipe(f"{scale}-oe").model.memory_layers
    lc = param_summary(cfg)["delta_params"]
    tn = param_summary(get_recipe(f"{scale}-tngram"))["delta_params"]
    assert abs(lc - tn) / tn < 0.002

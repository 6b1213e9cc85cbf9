"""The product-key (pkm), STEM (stem) and per-layer embedding (ple) memories: each forward equals
an independent brute-force computation written here, param_count is exact, the model stays
causal, incremental decoding equals the full forward, and the tables' row-sparse gradient holds
the dense gradient's touched rows."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tngram.common import TngramError
from tngram.memory import memory_config_classes, memory_config_from_dict, memory_config_to_dict
from tngram.memory.per_layer_embedding import PerLayerEmbeddingConfig
from tngram.memory.product_key import ProductKeyConfig
from tngram.memory.stem import StemConfig
from tngram.model.gpt import GPT, GPTConfig, param_counts

V, D = 53, 32
SMALL = {
    "pkm": ProductKeyConfig(n_keys=9, key_dim=8, topk=3, n_heads=2),
    "pkm-shared": ProductKeyConfig(n_keys=9, key_dim=8, topk=3, n_heads=2, shared_values=True),
    "stem": StemConfig(hidden=24, zero_init_down=False),
    "ple": PerLayerEmbeddingConfig(ple_dim=8, zero_init_proj=False),
    "ple-ungated": PerLayerEmbeddingConfig(ple_dim=8, gated=False, zero_init_proj=False),
}


def gpt(mem, layers=(0, 1), seed: int = 0) -> GPT:  # noqa: ANN001
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=V, n_layer=2, n_embd=D, n_head=2, n_kv_head=1, sequence_len=32,
                    memory=mem, memory_layers=layers)
    model = GPT(cfg).eval()
    with torch.no_grad():                      # non-zero output projections: every path matters
        for n, p in model.named_parameters():
            if n.endswith("proj.weight") and not p.any():
                p.normal_(0, 0.05)
    return model


def ids(b: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def rms(h: torch.Tensor) -> torch.Tensor:
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + torch.finfo(h.dtype).eps)


# ---- brute force -----------------------------------------------------------------------------
def test_product_keys_equal_a_top_k_over_every_slot():
    """The k best of all n^2 slots by q1.K1[a] + q2.K2[b] (scored one by one), softmax-weighted
    values, summed over heads: the product-key search finds exactly these slots."""
    cfg = SMALL["pkm"]
    torch.manual_seed(0)
    m = cfg.build(d_model=D, vocab_size=V)
    h = torch.randn(2, 5, D)
    got = m(h, ids(2, 5))
    n, k, H, half = cfg.n_keys, cfg.topk, cfg.n_heads, cfg.key_dim // 2
    Wq, K, Val = m.query.weight, m.keys, m.values
    want = torch.zeros(2, 5, D)
    with torch.no_grad():
        _brute_pkm(h, want, Wq, K, Val, n, k, H, half)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _brute_pkm(h, want, Wq, K, Val, n, k, H, half):  # noqa: ANN001, ANN202
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            q = Wq @ rms(h[b, t])                                  # (H * Kd,)
            for j in range(H):
                qj = q[2 * j * half: (2 * j + 2) * half]               # head j: (q1, q2)
                q1, q2 = qj[:half], qj[half:]
                score = {a * n + c: float(q1 @ K[j, 0, a] + q2 @ K[j, 1, c])
                         for a in range(n) for c in range(n)}
                best = sorted(score, key=lambda s: -score[s])[:k]
                w = torch.tensor([score[s] for s in best]).softmax(0)
                want[b, t] += sum(w[i] * Val[s] for i, s in enumerate(best))


def test_stem_is_a_gated_ffn_whose_up_projection_is_the_token_row():
    cfg = SMALL["stem"]
    torch.manual_seed(0)
    m = cfg.build(d_model=D, vocab_size=V)
    h, x = torch.randn(2, 5, D), ids(2, 5)
    want = torch.zeros(2, 5, D)
    for b in range(2):
        for t in range(5):
            g = m.gate.weight @ rms(h[b, t])
            want[b, t] = m.down.weight @ (g * torch.sigmoid(g) * m.up.weight[x[b, t]])
    torch.testing.assert_close(m(h, x), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["ple", "ple-ungated"])
def test_per_layer_embedding_is_the_projected_gated_token_row(name):
    cfg = SMALL[name]
    torch.manual_seed(0)
    m = cfg.build(d_model=D, vocab_size=V)
    h, x = torch.randn(2, 5, D), ids(2, 5)
    want = torch.zeros(2, 5, D)
    for b in range(2):
        for t in range(5):
            e = m.table.weight[x[b, t]]
            if cfg.gated:
                g = m.gate.weight @ rms(h[b, t])
                gelu = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
                e = gelu * e
            want[b, t] = m.proj.weight @ e
    torch.testing.assert_close(m(h, x), want, rtol=1e-4, atol=1e-6)


# ---- contract ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SMALL))
def test_param_count_is_exact_per_module_and_in_the_model(name):
    cfg = SMALL[name]
    layers = (0, 1)
    per = [cfg.param_count(d_model=D, vocab_size=V, layer_id=i, layer_ids=layers) for i in layers]
    mods = [cfg.build(d_model=D, vocab_size=V, layer_id=i, layer_ids=layers) for i in layers]
    cfg.link_layers(mods)
    assert [sum(p.numel() for p in m.parameters()) for m in mods] == per
    counts = param_counts(gpt(cfg).config)
    assert counts["memory_params"] == counts["delta_params"] == sum(per)
    assert gpt(cfg).memory_params() == sum(per)


def test_hand_counts():
    """W_q D*H*Kd + keys H*n*Kd + values n^2*D; U V*F + gate and down 2*D*F; E V*P + (1|2)*D*P."""
    assert SMALL["pkm"].param_count(d_model=D, vocab_size=V) == 32 * 16 + 2 * 9 * 8 + 81 * 32
    assert SMALL["pkm-shared"].param_count(d_model=D, vocab_size=V, layer_id=1,
                                           layer_ids=(0, 1)) == 32 * 16 + 2 * 9 * 8
    assert SMALL["stem"].param_count(d_model=D, vocab_size=V) == 53 * 24 + 2 * 32 * 24
    assert StemConfig().param_count(d_model=D, vocab_size=V) == 53 * 64 + 2 * 32 * 64
    assert SMALL["ple"].param_count(d_model=D, vocab_size=V) == 53 * 8 + 2 * 32 * 8
    assert SMALL["ple-ungated"].param_count(d_model=D, vocab_size=V) == 53 * 8 + 32 * 8


def test_shared_values_are_one_table_read_by_every_layer():
    model = gpt(SMALL["pkm-shared"])
    a, b = model.blocks[0].memory, model.blocks[1].memory
    assert a.values is b.values and "values" not in dict(b.named_parameters())
    assert a.table_parameters() == [a.values] and b.table_parameters() == []


def test_registered_kinds_round_trip_and_bad_fields():
    classes = memory_config_classes()
    for kind in ("pkm", "stem", "ple"):
        assert classes[kind].kind == kind and classes[kind].injection == "block"
    for cfg in SMALL.values():
        assert memory_config_from_dict(memory_config_to_dict(cfg)) == cfg
    with pytest.raises(TngramError, match="model.memory.topk"):
        ProductKeyConfig(n_keys=4, topk=5)
    with pytest.raises(TngramError, match="model.memory.key_dim must be even"):
        ProductKeyConfig(key_dim=7)
    with pytest.raises(TngramError, match="model.memory.ple_dim"):
        PerLayerEmbeddingConfig(ple_dim=0)
    with pytest.raises(TngramError, match=r"expects h of shape"):
        SMALL["stem"].build(d_model=D, vocab_size=V)(torch.zeros(2, 5, D + 1), ids(2, 5))


@pytest.mark.parametrize(
    "name, what",
    [("pkm", "product-key memory"), ("stem", "STEM memory"), ("ple", "per-layer embedding")],
)
def test_bad_forward_inputs_are_one_line_naming_the_memory(name, what, monkeypatch):
    """The shared input check (memory.token_tables.check_inputs): h of the wrong width, rank or
    (B, T), and ids of a float dtype or outside [0, V) are refused, each memory named."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "1")
    m = SMALL[name].build(d_model=D, vocab_size=V)
    shape = rf"{what} expects h of shape \(B, T, {D}\) matching input_ids \(B, T\); got h "
    for h in (torch.zeros(2, 5, D + 1), torch.zeros(2, 5, 1, D), torch.zeros(2, 4, D)):
        with pytest.raises(TngramError, match=shape + re.escape(str(tuple(h.shape)))):
            m(h, ids(2, 5))
    with pytest.raises(TngramError, match="input_ids must be an integer tensor"):
        m(torch.zeros(2, 5, D), ids(2, 5).float())
    with pytest.raises(TngramError, match=rf"input_ids must lie in \[0, {V}\)"):
        m(torch.zeros(2, 5, D), ids(2, 5) + V)
    assert m(torch.zeros(2, 5, D), ids(2, 5)).shape == (2, 5, D)


# ---- the model: causality and incremental decoding ---------------------------------------------
@pytest.mark.parametrize("name", list(SMALL))
def test_causal_in_the_model(name):
    model = gpt(SMALL[name])
    x = ids(2, 12)
    t = 7
    y = x.clone()
    y[:, t] = (x[:, t] + 5) % V
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert (a[:, t:] - b[:, t:]).abs().max() > 1e-4


@pytest.mark.parametrize("name", list(SMALL))
def test_incremental_decode_equals_the_full_forward(name):
    model = gpt(SMALL[name])
    x = ids(2, 12)
    with torch.no_grad():
        full = model(x)
        cache: dict = {}
        parts = [model(x[:, :5], cache=cache)] + [model(x[:, i:i + 1], cache=cache)
                                                  for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


# ---- row-sparse table gradients ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(SMALL))
def test_sparse_table_gradient_is_the_touched_rows_of_the_dense_one(name):
    dense, sparse = gpt(SMALL[name]).train(), gpt(SMALL[name]).train()
    mods = [b.memory for b in sparse.blocks]
    for m in mods:
        m.sparse_grad = True
    x, tgt = ids(2, 12), ids(2, 12, seed=3)
    dense(x, tgt).backward()
    sparse(x, tgt).backward()
    n_tables = 0
    for md, ms in zip((b.memory for b in dense.blocks), mods):
        for pd, ps in zip(md.table_parameters(), ms.table_parameters()):
            n_tables += 1
            assert ps.grad.is_sparse
            g = ps.grad.coalesce()
            rows = g.indices()[0]
            assert 0 < rows.numel() < ps.shape[0]
            torch.testing.assert_close(g.to_dense(), pd.grad, rtol=1e-5, atol=1e-7)
            untouched = torch.ones(ps.shape[0], dtype=torch.bool)
            untouched[rows] = False
            assert not pd.grad[untouched].any()        # the dense gradient: unread rows are 0
    assert n_tables == (1 if name == "pkm-shared" else 2)


@pytest.mark.parametrize("name", list(SMALL))
def test_contract_keyword_only_build_and_disjoint_tables_and_controls(name):
    cfg = SMALL[name]
    with pytest.raises(TypeError):
        cfg.build(D, V)                                         # keyword-only
    m = cfg.build(d_model=D, vocab_size=V)
    own = {id(p) for p in m.parameters()}
    tables = {id(p) for p in m.table_parameters()}
    controls = {id(p) for p in m.control_parameters()}
    assert tables and tables <= own and controls <= own and not tables & controls
    assert all(p.dim() == 2 for p in m.table_parameters())
    from tngram.optim.groups import assign_groups
    groups = assign_groups(gpt(cfg))
    assert {g for n, g in groups.items() if ".memory." in n and n.endswith(
        ("values", "up.weight", "table.weight"))} == {"memory_table"}
    assert all(g == "muon" for n, g in groups.items() if n.endswith(
        ("memory.query.weight", "memory.gate.weight", "memory.down.weight", "memory.proj.weight")))
    assert all(g == "scalar" for n, g in groups.items() if n.endswith("memory.keys"))

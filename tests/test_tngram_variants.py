"""TN-gram variants beyond the paper (kind tngram-variant, tngram.memory.tngram_variants): each
switch against a brute-force computation written here, causality, incremental decode = full
forward, parameter counting and optimiser grouping of shared factors, checkpoint / HF round trips,
and the variant kind with every field at its default being the paper's module, bit for bit.
Loading configs of the earlier spelling (variants as fields of kind tngram):
tests/test_tngram_config_kinds.py."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from tngram.common import TngramError
from tngram.memory.tngram import TNGramConfig
from tngram.memory.tngram_variants import TNGramVariantConfig
from tngram.model.gpt import GPT, GPTConfig

from test_train_support import TINY_VOCAB, one_thread, tiny_data  # noqa: F401,E402  (fixtures)

V, R, D, N = 13, 6, 8, 4
PAD = 0

VARIANTS = {  # "lean" is the paper's own ablations (kind tngram); the others are tngram-variant's
    "lean": dict(use_norm=False, use_absorption=False),
    "sum": dict(order_combine="sum"),
    "kv_rank": dict(kv_rank=5),
    "hybrid": dict(hash_orders=(3, 4), hash_heads=2, hash_embed=6, hash_budget=17),
    "share": dict(share_factors=True),
    # the pareto family tngram-hsum: orders summed in rank space, then hashed orders beside them
    "hybrid_sum": dict(order_combine="sum", hash_orders=(2, 3, 4), hash_heads=2, hash_embed=6, hash_budget=17),
    "all": dict(order_combine="sum", kv_rank=5, share_factors=True, hash_orders=(4,),
                hash_heads=2, hash_embed=4, hash_budget=11, use_norm=False),
}


def variant(**kw):
    """The config of these fields: kind tngram-variant when one of them is a variant field."""
    cls = TNGramVariantConfig if set(kw) & set(TNGramConfig.moved_fields) else TNGramConfig
    return cls(**kw)


def make(layer_id=1, layer_ids=(1, 3), **kw):
    torch.manual_seed(0)
    cfg = variant(max_ngram=N, cp_rank=R, zero_init_value=False, zero_init_conv=False,
                       fused=kw.pop("fused", False), pad_id=PAD, **kw)
    m = cfg.build(d_model=D, vocab_size=V, layer_id=layer_id, layer_ids=layer_ids)
    with torch.no_grad():
        if m.absorb is not None:
            m.absorb.copy_(torch.randn_like(m.absorb))
        if m.log_scales is not None:
            m.log_scales.copy_(0.3 * torch.randn_like(m.log_scales))
    return m


# ---- brute force, position by position, from the definitions -----------------------------

def brute_orders(m, ids: list[int], t: int) -> list[torch.Tensor]:
    """[e_2, ..., e_N] at position t: b_n = w_1..w_{N-n} * A_{N-n+1}[x_{t-n+1}] ... A_N[x_t],
    e_n = exp(l_n) * b_n / rms(b_n) (or b_n without the norm)."""
    c = m.config
    out = []
    for n in range(2, N + 1):
        b = torch.ones(R)
        if m.absorb is not None:
            for j in range(N - n):
                b = b * m.absorb[j]
        for i in range(N - n + 1, N + 1):
            pos = t - (N - i)
            b = b * m.factors[i - 1, ids[pos] if pos >= 0 else c.pad_id]
        e = b / torch.sqrt((b * b).mean() + c.norm_eps) if c.use_norm else b
        out.append(e * (math.exp(m.log_scales[n - 2].item()) if m.log_scales is not None else 1.0))
    return out


def is_prime(p: int) -> bool:
    return p >= 2 and all(p % q for q in range(2, int(p ** 0.5) + 1))


def brute_primes(budget: int, n_orders: int, heads: int, layer_ids, layer) -> list[list[int]]:
    """Engram's allocation (§2.4) by trial division: distinct primes over (layer, order, head)."""
    seen, out = set(), {}
    for lid in layer_ids:
        per = []
        for _ in range(n_orders):
            p, heads_p = budget - 1, []
            for _ in range(heads):
                p += 1
                while p in seen or not is_prime(p):
                    p += 1
                seen.add(p)
                heads_p.append(p)
            per.append(heads_p)
        out[lid] = per
    return out[layer]


def brute_hash_vector(m, ids: list[int], t: int, layer_ids=(1, 3), layer=1) -> torch.Tensor:
    """The hybrid's table rows at t: z = (XOR_{k<n} x_{t-k} * mult_k) mod p_{n,j}, concatenated."""
    c = m.config
    rng = np.random.default_rng(c.hash_seed + 10007 * layer)       # Engram's multipliers (§2.3)
    bound = max(1, ((2 ** 63 - 1) // V) // 2)
    mult = [int(r) * 2 + 1 for r in rng.integers(0, bound, size=N, dtype=np.int64)]
    primes = brute_primes(c.hash_budget, len(c.hash_orders), c.hash_heads, layer_ids, layer)
    offset, parts = 0, []
    for n, ps in zip(c.hash_orders, primes):
        mix = 0
        for k in range(n):
            tok = ids[t - k] if t - k >= 0 else c.pad_id
            mix ^= tok * mult[k]
        for p in ps:
            parts.append(m.hashed.table.weight[offset + mix % p])
            offset += p
    return torch.cat(parts)


def brute_kv_input(m, ids: list[int], t: int) -> torch.Tensor:
    c = m.config
    orders = brute_orders(m, ids, t)
    summed = getattr(c, "order_combine", "concat") == "sum"
    e = torch.stack(orders).sum(0) if summed else torch.cat(orders)
    if getattr(c, "hash_orders", ()):
        e = torch.cat([e, brute_hash_vector(m, ids, t)])
    if getattr(c, "kv_rank", 0):
        e = m.kv_down.weight @ e
    return e


@pytest.mark.parametrize("name", ["lean", "sum", "kv_rank", "hybrid", "hybrid_sum", "all"])
@pytest.mark.parametrize("fused", [False, True])
def test_output_equals_brute_force(name, fused):
    m = make(fused=fused, **VARIANTS[name])
    ids = torch.randint(0, V, (2, 9))
    h = torch.randn(2, 9, D)
    want = torch.stack([torch.stack([brute_kv_input(m, row, t) for t in range(9)])
                        for row in ids.tolist()])
    with torch.no_grad():
        torch.testing.assert_close(m(h, ids), m.fusion(h, want), rtol=1e-5, atol=1e-5)
    assert m.fusion.d_mem == want.shape[-1]


def test_sum_is_narrower_and_hybrid_adds_a_table():
    paper, s = make(), make(order_combine="sum")
    assert paper.fusion.d_mem == (N - 1) * R and s.fusion.d_mem == R
    hy = make(**VARIANTS["hybrid"])
    assert hy.fusion.d_mem == (N - 1) * R + 2 * 6
    # rows: 2 orders x 2 heads of distinct primes >= 17 after layer 1's (first in layer_ids)
    assert hy.hashed.n_rows == sum(map(sum, brute_primes(17, 2, 2, (1, 3), 1))) == 17 + 19 + 23 + 29
    assert any(p is hy.hashed.table.weight for p in hy.table_parameters())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_param_count_equals_module(name):
    for layer in (1, 3):
        m = make(layer_id=layer, **VARIANTS[name])
        cfg = m.config
        n = cfg.param_count(d_model=D, vocab_size=V, layer_id=layer, layer_ids=(1, 3))
        own = sum(p.numel() for p in m.parameters())
        # a shared-factor layer other than the first does not count the factors (the model ties them)
        extra = N * V * R if getattr(cfg, "share_factors", False) and layer == 3 else 0
        assert n + extra == own


@pytest.mark.parametrize("name", list(VARIANTS))
def test_module_causality(name):
    assert_causal(make(fused=True, **VARIANTS[name]))


def assert_causal(m, vocab_size: int = V, d_model: int = D) -> None:
    """Other ids and inputs from position 7 on: outputs before 7 are unchanged, those after not."""
    ids, h = torch.randint(0, vocab_size, (2, 12)), torch.randn(2, 12, d_model)
    ids2, h2 = ids.clone(), h.clone()
    ids2[:, 7:] = (ids2[:, 7:] + 1) % vocab_size
    h2[:, 7:] = torch.randn(2, 5, d_model)
    with torch.no_grad():
        y, y2 = m(h, ids), m(h2, ids2)
    torch.testing.assert_close(y[:, :7], y2[:, :7], rtol=0, atol=0)
    assert not torch.allclose(y[:, 7:], y2[:, 7:])


def tiny_gpt(memory: TNGramConfig, layers=(0, 1), vocab_size: int = V) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab_size, n_layer=2, n_embd=16, n_head=2, n_kv_head=1, sequence_len=32,
                    memory=memory, memory_layers=layers)
    model = GPT(cfg).eval()
    with torch.no_grad():   # zero-init projections would hide the memory
        for n, p in model.named_parameters():
            if n.endswith("proj.weight") and p.abs().sum() == 0:
                p.normal_(0, 0.05)
    return model


def mem_cfg(name: str) -> TNGramConfig:
    return variant(max_ngram=N, cp_rank=R, zero_init_value=False, zero_init_conv=False,
                        **VARIANTS[name])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gpt_decode_equals_full_forward_and_is_causal(name):
    model = tiny_gpt(mem_cfg(name))
    ids = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        full = model(ids)
        cache: dict = {}
        steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, t:t + 1], cache=cache)
                                                     for t in range(4, 11)]
        inc = torch.cat(steps, dim=1)
        torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)
        ids2 = ids.clone()
        ids2[:, 6] = (ids2[:, 6] + 3) % V
        full2 = model(ids2)
    torch.testing.assert_close(full[:, :6], full2[:, :6], rtol=0, atol=0)
    assert not torch.allclose(full[:, 6:], full2[:, 6:])


# ---- shared factors -------------------------------------------------------------------------

def test_shared_factors_are_one_parameter_counted_grouped_and_saved_once(tmp_path):
    from tngram.optim.groups import assign_groups
    from tngram.train.checkpoint import load_weights, save_final_weights

    cfg = mem_cfg("share")
    model = tiny_gpt(cfg)
    a, b = model.blocks[0].memory, model.blocks[1].memory
    assert a.factors is b.factors
    names = [n for n, _ in model.named_parameters() if n.endswith("factors")]
    assert names == ["blocks.0.memory.factors"]
    assert [k for k in model.state_dict() if k.endswith("factors")] == names
    raw = GPT(replace(model.config, memory=None))
    per_layer = [cfg.param_count(d_model=16, vocab_size=V, layer_id=i, layer_ids=(0, 1)) for i in (0, 1)]
    assert model.num_params() - raw.num_params() == sum(per_layer) == model.memory_params()
    assert per_layer[0] - per_layer[1] == N * V * R
    groups = assign_groups(model)
    assert groups["blocks.0.memory.factors"] == "memory_table"
    assert not any("blocks.1.memory.factors" in n for n in groups)
    # the weights file holds the factors once and loads back into a fresh model
    save_final_weights(tmp_path, model, 1)
    fresh = tiny_gpt(cfg)
    with torch.no_grad():
        fresh.blocks[0].memory.factors.zero_()
    load_weights(fresh, tmp_path / "model.safetensors")
    assert fresh.blocks[1].memory.factors is fresh.blocks[0].memory.factors
    ids = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        assert torch.equal(fresh(ids), model(ids))


def test_shared_factors_equal_two_copies_with_summed_gradient():
    """Brute force: an unshared model holding the same factors in both layers gives the same
    logits, and the shared gradient is the sum of the two copies' gradients."""
    shared = tiny_gpt(mem_cfg("share"))
    plain = tiny_gpt(TNGramConfig(max_ngram=N, cp_rank=R, zero_init_value=False, zero_init_conv=False))
    sd = shared.state_dict()
    sd["blocks.1.memory.factors"] = sd["blocks.0.memory.factors"].clone()
    plain.load_state_dict(sd)
    ids = torch.randint(0, V, (2, 10))
    tgt = torch.randint(0, V, (2, 10))
    shared(ids, tgt).backward()
    plain(ids, tgt).backward()
    torch.testing.assert_close(shared(ids), plain(ids))
    g = plain.blocks[0].memory.factors.grad + plain.blocks[1].memory.factors.grad
    torch.testing.assert_close(shared.blocks[0].memory.factors.grad, g)
    assert plain.blocks[1].memory.factors.grad.abs().sum() > 0


def test_shared_factors_follow_device_and_dtype_moves():
    model = tiny_gpt(mem_cfg("share")).to(torch.float64)
    assert model.blocks[1].memory.factors.dtype == torch.float64
    assert model.blocks[1].memory.factors is model.blocks[0].memory.factors


# ---- defaults and config ---------------------------------------------------------------------

def test_variant_kind_at_its_defaults_is_the_paper_bit_for_bit():
    """kind tngram-variant with every variant field at its default: the paper's parameters (same
    names, same values from the same seed) and the same output, bit for bit."""
    paper, var = make(fused=True), make(fused=True, order_combine="concat")
    assert type(var.config) is TNGramVariantConfig and type(paper.config) is TNGramConfig
    assert var.hashed is None and var.kv_down is None
    assert var.fusion.d_mem == paper.fusion.d_mem == (N - 1) * R
    sd, vd = paper.state_dict(), var.state_dict()
    assert list(sd) == list(vd) and all(torch.equal(sd[k], vd[k]) for k in sd)
    ids, h = torch.randint(0, V, (2, 9)), torch.randn(2, 9, D)
    with torch.no_grad():
        assert torch.equal(paper(h, ids), var(h, ids))
    on = TNGramVariantConfig(max_ngram=N, cp_rank=R, hash_orders=(3,), kv_rank=4)
    assert on.param_count(d_model=D, vocab_size=V) == sum(
        p.numel() for p in on.build(d_model=D, vocab_size=V).parameters())


@pytest.mark.parametrize("kw,msg", [
    ({"order_combine": "mean"}, "order_combine"),
    ({"hash_orders": (1,)}, "hash_orders"),
    ({"hash_orders": (4, 3)}, "hash_orders"),
    ({"hash_orders": (3,), "hash_embed": 5, "hash_heads": 2}, "hash_embed"),
    ({"share_factors": True, "prune_at_step": 5, "min_cp_rank": 2}, "prune_at_step")])
def test_bad_variant_configs(kw, msg):
    with pytest.raises(TngramError, match=msg):
        TNGramVariantConfig(max_ngram=N, cp_rank=R, **kw)


def test_lean_recipe_is_the_ablation_winners():
    from tngram.train.recipes import get_recipe
    lean, paper = get_recipe("mini-tngram-lean"), get_recipe("mini-tngram")
    assert lean.model.memory == replace(paper.model.memory, use_norm=False, use_absorption=False)
    assert replace(lean, name=paper.name).to_dict() == paper.to_dict() | {
        "model": paper.to_dict()["model"] | {"memory": paper.to_dict()["model"]["memory"]
                                             | {"use_norm": False, "use_absorption": False}}}


def test_hsum_recipe_is_the_pareto_point_it_names():
    """`mini-tngram-hsum` is the config the pareto map trains as tngram-hsum at its 4.3 M size (table
    lr x4), apart from its name, and its Δparams is <= mini-engram's."""
    from research.experiments import pareto as P
    from tngram.experiments.common import base_recipe
    from tngram.train.recipes import get_recipe, param_summary
    bases = {m: base_recipe("mini", m) for m in ("raw", "engram", "tngram", "oe")}
    point = P.with_table_lr(P.family_config("tngram-hsum", 3929, bases), P.TUNED_DEFAULT["tngram-hsum"])
    recipe = get_recipe("mini-tngram-hsum")
    assert replace(recipe, name=point.name).to_dict() == point.to_dict()
    assert recipe.optim.memory_table_lr == pytest.approx(4 * 0.05)     # x4 the recipe table lr 0.05
    assert param_summary(recipe)["delta_params"] <= param_summary(get_recipe("mini-engram"))["delta_params"]


# ---- Hugging Face add_memory ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["lean", "sum", "kv_rank", "hybrid", "hybrid_sum", "share", "all"])
def test_hf_add_memory_causal_and_cached_generation(name):
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import VOCAB, prompt, tiny_model
    from tngram.hf import add_memory, memory_modules

    cfg = variant(max_ngram=3, cp_rank=8, zero_init_value=False, zero_init_conv=False,
                  **{k: (tuple(o for o in v if o <= 3) if k == "hash_orders" else v)
                     for k, v in VARIANTS[name].items()})
    plain = tiny_model("llama")
    model = add_memory(tiny_model("llama"), cfg, layers=(0, 2), memory_seed=1)
    mods = list(memory_modules(model).values())
    if getattr(cfg, "share_factors", False):
        assert mods[0].factors is mods[1].factors
        assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in plain.parameters()) \
            == sum(cfg.param_count(d_model=32, vocab_size=VOCAB, layer_id=i, layer_ids=(0, 2))
                   for i in (0, 2))
    x = prompt(2, 10)
    y = x.clone()
    y[:, 6] = (x[:, 6] + 7) % (VOCAB - 1) + 1
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
        torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
        assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-4
        cached = model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        full = model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, full)


def test_hf_save_round_trip_with_shared_factors_and_hybrid(tmp_path):
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import prompt, tiny_model
    from transformers import AutoModelForCausalLM
    from tngram.hf import add_memory, memory_modules

    cfg = TNGramVariantConfig(max_ngram=3, cp_rank=8, zero_init_value=False, zero_init_conv=False,
                              share_factors=True, hash_orders=(3,), hash_heads=2, hash_embed=4,
                              hash_budget=11)
    model = add_memory(tiny_model("llama"), cfg, layers=(0, 2), memory_seed=1)
    x = prompt(2, 9)
    with torch.no_grad():
        before = model(x).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    mods = list(memory_modules(loaded).values())
    assert mods[0].factors is mods[1].factors
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, before)



def test_export_to_hf_with_every_variant(tmp_path, tiny_data):  # noqa: F811
    """`tngram export RUN --hf DIR` of a run with every switch on: same tensors, same logits,
    cached generation equals our full forward recomputed token by token."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from test_hf_export import assert_export_round_trip
    from tngram.memory import with_memory_fields
    from tngram.train.recipes import get_recipe

    mem = with_memory_fields(get_recipe("mini-tngram").model.memory, cp_rank=8, max_ngram=3,
                             zero_init_value=False, zero_init_conv=False,
                             **{**VARIANTS["all"], "hash_orders": (3,)})
    assert_export_round_trip(tmp_path, tiny_data, mem)

"""Adaptive CP rank (tngram.memory.cp_rank): scores, choice, physical pruning, optimiser state,
resume across the pruning step, over-pruning guard and parameter counts."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch

from test_train_support import losses, one_thread, tiny_config, tiny_data, weights  # noqa: F401
from tngram.common import TngramError
from tngram.memory.cp_rank import (choose_keep, component_scores, log_scale_correction, prune_model,
                                   prune_tngram)
from tngram.memory.tngram import TNGram, TNGramConfig
from tngram.model.gpt import GPT
from tngram.optim.muon import Muon
from tngram.train import checkpoint as ckpt
from tngram.train.loop import train

V, D = 7, 12


def make(N: int = 4, R: int = 6, hc_mult: int = 1, fused: bool = True, seed: int = 0, **kw) -> TNGram:
    torch.manual_seed(seed)
    m = TNGram(TNGramConfig(max_ngram=N, cp_rank=R, hc_mult=hc_mult, fused=fused, **kw), D, V)
    with torch.no_grad():   # leave the zero init: K/V, absorption, scales and conv all non-trivial
        m.fusion.value_proj.weight.normal_()
        m.fusion.conv.weight.normal_(std=0.3)
        if m.absorb is not None:
            m.absorb.uniform_(0.5, 1.5)
        if m.log_scales is not None:
            m.log_scales.uniform_(-0.5, 0.5)
    return m


def run(m: TNGram, ids: torch.Tensor, hc_mult: int = 1) -> torch.Tensor:
    torch.manual_seed(123)
    h = torch.randn(ids.shape[0], ids.shape[1], hc_mult, D) if hc_mult > 1 else torch.randn(*ids.shape, D)
    return m(h, ids)


# ---- choose_keep

def test_choose_keep_smallest_set_holding_the_energy():
    s = torch.tensor([0.0, 5.0, 1.0, 4.0])            # sorted 5, 4, 1, 0: cumulative 5, 9, 10, 10
    assert choose_keep(s, 0.0, 1).tolist() == [1, 2, 3]     # 10 of 10 needs three; the zero goes
    assert choose_keep(s, 0.1, 1).tolist() == [1, 3]        # 9 >= 0.9 * 10
    assert choose_keep(s, 0.55, 1).tolist() == [1]          # 5 >= 0.45 * 10
    assert choose_keep(s, 0.1, 3).tolist() == [1, 2, 3]     # over-pruning guard
    assert choose_keep(s, 0.1, 9).tolist() == [0, 1, 2, 3]  # guard capped at R
    assert choose_keep(torch.zeros(5), 0.1, 2).tolist() == [0, 1]


# ---- scores against a brute-force expectation over every n-gram

def test_component_scores_match_enumeration():
    N, R = 3, 5
    m = make(N=N, R=R, hc_mult=2)
    A, w, l = m.factors.detach().double(), m.absorb.detach().double(), m.log_scales.detach().double()
    score = torch.zeros(R, dtype=torch.float64)
    for n in range(2, N + 1):
        W = torch.ones(R, dtype=torch.float64)
        for j in range(N - n):                        # w_1 * ... * w_{N-n}
            W = W * w[j]
        eb2 = torch.zeros(R, dtype=torch.float64)
        for toks in itertools.product(range(V), repeat=n):    # x_{t-n+1}..x_t, all V^n n-grams
            b = W.clone()
            for i, x in enumerate(toks):
                b = b * A[N - n + i, x]              # A_{N-n+1+i}
            eb2 += b * b
        eb2 /= V ** n
        ee2 = math.exp(2 * l[n - 2]) * eb2 / eb2.mean()
        proj = sum(lin.weight.detach().double()[:, (n - 2) * R:(n - 1) * R].pow(2).sum(0)
                   for lin in [*m.fusion.key_proj, m.fusion.value_proj])
        score += ee2 * proj
    assert torch.allclose(component_scores(m), score, rtol=1e-10)


# ---- pruning

@pytest.mark.parametrize("fused,hc_mult", [(True, 1), (False, 1), (True, 2)])
def test_pruning_exactly_zero_components_preserves_the_function(fused, hc_mult):
    N, R = 4, 9
    m = make(N=N, R=R, hc_mult=hc_mult, fused=fused)
    dead = [1, 4, 5, 8]
    with torch.no_grad():
        m.factors[N - 1, :, dead] = 0.0                # A_N: used by every order -> b_n[r] = 0
    ids = torch.randint(0, V, (3, 11))
    before = run(m, ids, hc_mult)
    keep = choose_keep(component_scores(m), 0.0, 1)
    assert keep.tolist() == [0, 2, 3, 6, 7]
    # RMSNorm's denominator: the mean of b^2 now runs over 5 entries instead of 9, for every token
    assert torch.allclose(log_scale_correction(m, keep), torch.full((N - 1,), 0.5 * math.log(9 / 5)).double())
    prune_tngram(m, keep)
    after = run(m, ids, hc_mult)
    assert torch.allclose(before, after, rtol=1e-5, atol=1e-5)  # equal up to RMSNorm's eps


def test_shapes_and_param_count_after_pruning():
    N, R = 4, 10
    m = make(N=N, R=R, hc_mult=2, seed=3)
    old = {k: v.clone() for k, v in m.state_dict().items()}
    keep = torch.tensor([0, 3, 4, 9])
    prune_tngram(m, keep)
    Rk = 4
    cols = torch.cat([torch.tensor([0, 3, 4, 9]) + n * R for n in range(N - 1)])
    assert m.factors.shape == (N, V, Rk) and torch.equal(m.factors, old["factors"][:, :, keep])
    assert m.absorb.shape == (N - 2, Rk) and torch.equal(m.absorb, old["absorb"][:, keep])
    for name in ("fusion.value_proj.weight", "fusion.key_proj.0.weight", "fusion.key_proj.1.weight"):
        w = dict(m.named_parameters())[name]
        assert w.shape == (D, (N - 1) * Rk) and torch.equal(w, old[name][:, cols])
    assert m.fusion.value_proj.in_features == (N - 1) * Rk and m.config.cp_rank == Rk
    assert sum(p.numel() for p in m.parameters()) == m.config.param_count(d_model=D, vocab_size=V)
    assert sum(p.numel() for p in m.parameters()) == replace(m.config, cp_rank=R).param_count(d_model=D, vocab_size=V) \
        - (R - Rk) * (N * V + (N - 2) + 3 * (N - 1) * D)   # factors, absorb, 2 keys + 1 value


def test_pruned_module_is_causal():
    m = make(N=4, R=8)
    prune_tngram(m, torch.tensor([1, 2, 6]))
    ids = torch.randint(0, V, (2, 12))
    ids2 = ids.clone()
    ids2[:, 7:] = (ids2[:, 7:] + 1) % V
    a, b = run(m, ids), run(m, ids2)
    assert torch.equal(a[:, :7], b[:, :7]) and not torch.allclose(a[:, 7:], b[:, 7:])


def test_optimizer_state_is_sliced_with_the_parameters():
    N, R = 4, 8
    m = make(N=N, R=R)
    lin = [m.fusion.key_proj[0].weight, m.fusion.value_proj.weight]
    rest = [p for p in m.parameters() if all(p is not q for q in lin)]
    adam, muon = torch.optim.Adam(rest, lr=0.01), Muon(lin, lr=0.01)
    ids = torch.randint(0, V, (2, 9))
    for _ in range(2):
        run(m, ids).square().mean().backward()
        adam.step(), muon.step()
        m.zero_grad()
    def states():   # {param name: (its optimiser, {state key: tensor})}
        return {n: (opt, {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v) and v.dim()})
                for n, p in m.named_parameters() for opt in (adam, muon) if p in opt.state}
    old = states()
    keep = torch.tensor([0, 2, 3, 7])
    cols = torch.cat([keep + n * R for n in range(N - 1)])
    prune_tngram(m, keep, [adam, muon])
    new = states()
    where = {"factors": (2, keep), "absorb": (1, keep), "fusion.key_proj.0.weight": (1, cols),
             "fusion.value_proj.weight": (1, cols)}
    assert new.keys() == old.keys() and set(where) <= set(new)
    for name, (opt, st) in new.items():
        p = dict(m.named_parameters())[name]
        assert old[name][0] is opt and st.keys() == old[name][1].keys()
        assert any(q is p for g in opt.param_groups for q in g["params"])   # groups hold the new param
        for k, v in st.items():
            exp = old[name][1][k].index_select(*where[name]) if name in where else old[name][1][k]
            assert v.shape == p.shape and torch.equal(v, exp), (name, k)
    n_params = sum(len(g["params"]) for o in (adam, muon) for g in o.param_groups)
    assert n_params == len(list(m.parameters()))
    run(m, ids).square().mean().backward()      # the optimisers keep working on the new shapes
    adam.step(), muon.step()


def test_over_pruning_guard_and_config_checks():
    m = make(N=3, R=12, prune_energy_tol=0.99, min_cp_rank=5)
    assert prune_model(m) == [("", 12, 5)] and m.factors.shape[2] == 5
    with pytest.raises(TngramError, match="min_cp_rank"):
        TNGramConfig(cp_rank=4, min_cp_rank=5, prune_at_step=3)       # checked at construction
    with pytest.raises(TngramError, match="prune_energy_tol"):
        TNGramConfig(prune_energy_tol=1.0)


# ---- training: pruning step, resume across it, sizes, loading

PRUNE = ["model.memory.cp_rank=16", "model.memory.prune_at_step=3", "model.memory.prune_energy_tol=0.3",
         "model.memory.min_cp_rank=2", "schedule.steps=6", "schedule.warmdown_steps=2", "run.val_every=0",
         "run.checkpoint_every=2"]


def test_resume_across_the_pruning_step_is_bit_identical(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, extra=PRUNE)
    ref = train(cfg, tmp_path / "ref")
    first = train(cfg, tmp_path / "run", max_steps=4)       # checkpoint at 4: after pruning at 3
    assert first["steps"] == 4
    fresh = GPT(cfg.model)                                  # built at the starting rank 16 ...
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "run"), fresh)["step"] == 4
    assert fresh.blocks[1].memory.factors.shape[-1] < 16    # ... shrunk to the stored shapes
    resumed = train(cfg, tmp_path / "run", resume=True)
    assert losses(tmp_path / "ref") == losses(tmp_path / "run") and len(losses(tmp_path / "ref")) == 6
    wa, wb = weights(tmp_path / "ref"), weights(tmp_path / "run")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    (r_final,) = ref["cp_ranks"]
    assert 2 <= r_final < 16 and resumed["cp_ranks"] == [r_final]
    assert wa["blocks.1.memory.factors"].shape[-1] == r_final
    # Δparams reflect the pruned size: the loaded model's count minus the raw backbone's
    model, _ = ckpt.load_run_model(tmp_path / "run")
    raw = tiny_config(tiny_data, recipe="mini-raw")
    assert ref["delta_params"] == resumed["delta_params"] == model.num_params() - GPT(raw.model).num_params()
    assert ref["delta_params"] == replace(cfg.model.memory, cp_rank=r_final).param_count(d_model=32, vocab_size=512)


def test_prune_step_must_lie_inside_the_schedule(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, extra=PRUNE + ["model.memory.prune_at_step=6"])
    with pytest.raises(TngramError, match="prune_at_step"):
        train(cfg, tmp_path)
    assert not (tmp_path / "summary.json").exists()

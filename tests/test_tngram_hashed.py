"""TN-gram with hashed factor rows (tngram.memory.tngram_hashed): the forward against a brute-force
computation written here from the docstring's equations, the paper's module as the special case
V' = V, k = 1, exact parameter count, causality, incremental decode = full forward, row-sparse
training = dense, HF add_memory / export round trips."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tngram.memory.tngram import TNGramConfig
from tngram.memory.tngram_hashed import TNGramHashedConfig, hash_rows
from tngram.model.gpt import GPT

from test_train_support import TINY_VOCAB, one_thread, tiny_data  # noqa: F401,E402  (fixtures)
from test_tngram_variants import assert_causal, tiny_gpt as variants_tiny_gpt  # noqa: E402

V, R, D, N, VP = 29, 6, 8, 4, 7   # V' = 7: 7^2 >= 29, so (h_1, h_2) is distinct per token
PAD = 0
SETTINGS = {
    "prod2": dict(n_hashes=2),
    "prod3": dict(n_hashes=3),
    "sum2": dict(n_hashes=2, combine="sum"),
    "sum3_lean": dict(n_hashes=3, combine="sum", use_norm=False, use_absorption=False),
}


def make(**kw):
    torch.manual_seed(0)
    cfg = TNGramHashedConfig(max_ngram=N, cp_rank=R, factor_rows=kw.pop("factor_rows", VP),
                             zero_init_value=False, zero_init_conv=False, pad_id=PAD, **kw)
    m = cfg.build(d_model=D, vocab_size=V, layer_id=1, layer_ids=(1, 3))
    with torch.no_grad():
        if m.absorb is not None:
            m.absorb.copy_(torch.randn_like(m.absorb))
        if m.log_scales is not None:
            m.log_scales.copy_(0.3 * torch.randn_like(m.log_scales))
        if m.importance is not None:
            m.importance.copy_(torch.randn_like(m.importance))
    return m


def brute_hash(x: int, j: int, rows: int, seed: int) -> int:
    if j == 0:
        return x % rows
    if j == 1:
        return (x // rows) % rows
    g = torch.Generator().manual_seed(1_000_003 + seed)
    a, c = torch.randint(1, 2 ** 31 - 1, (j - 1, 2), generator=g).tolist()[j - 2]
    return ((a * x + c) % (2 ** 31 - 1)) % rows


def brute_factor(m, i: int, x: int) -> torch.Tensor:
    """A~_i[x] (i = 1..N): the docstring's prod / importance-weighted sum of k pool rows."""
    c = m.config
    rows = [m.factors[i - 1, brute_hash(x, j, c.factor_rows, c.hash_seed)]
            for j in range(c.n_hashes)]
    if c.combine == "prod":
        out = torch.ones(R)
        for r in rows:
            out = out * r
        return out
    return sum(m.importance[i - 1, x, j] * r for j, r in enumerate(rows))


def brute_e(m, ids: list[int], t: int) -> torch.Tensor:
    c = m.config
    out = []
    for n in range(2, N + 1):
        b = torch.ones(R)
        if m.absorb is not None:
            for j in range(N - n):
                b = b * m.absorb[j]
        for i in range(N - n + 1, N + 1):
            pos = t - (N - i)
            b = b * brute_factor(m, i, ids[pos] if pos >= 0 else c.pad_id)
        e = b / torch.sqrt((b * b).mean() + c.norm_eps) if c.use_norm else b
        out.append(e * (math.exp(m.log_scales[n - 2].item()) if m.log_scales is not None else 1.0))
    return torch.cat(out)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_output_equals_brute_force(name):
    m = make(**SETTINGS[name])
    ids = torch.randint(0, V, (2, 9))
    h = torch.randn(2, 9, D)
    want = torch.stack([torch.stack([brute_e(m, row, t) for t in range(9)])
                        for row in ids.tolist()])
    with torch.no_grad():
        torch.testing.assert_close(m(h, ids), m.fusion(h, want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["prod2", "sum2"])
def test_theorem_1_holds_on_the_hashed_factors(name):
    """Paper Theorem 1 with A~ for A: b_{n-1}(x_{N-n+2:N}) = sum_x c_x b_n(x, x_{N-n+2:N}), with c
    solving A~_{N-n+1}^T c = w_{N-n+1} (A~ has full column rank: V >= R, distinct row pairs)."""
    m = make(**SETTINGS[name])
    with torch.no_grad():
        for n in range(3, N + 1):
            A = torch.stack([brute_factor(m, N - n + 1, x) for x in range(V)]).double()  # (V, R)
            assert torch.linalg.matrix_rank(A) == R
            w = m.absorb[N - n].double()                                  # w_{N-n+1}
            c = torch.linalg.pinv(A.T) @ w  # (V,): gelsy lstsq can be wrong (pytorch#92537)
            torch.testing.assert_close(A.T @ c, w, rtol=1e-10, atol=1e-10)
            rest = torch.randint(0, V, (n - 1,)).tolist()                 # x_{N-n+2:N}
            def b(k, toks):  # b_k of the k-gram toks (oldest first), Eq. 10 without the norm
                out = torch.ones(R, dtype=torch.float64)
                for j in range(N - k):
                    out = out * m.absorb[j].double()
                for i, x in zip(range(N - k + 1, N + 1), toks):
                    out = out * brute_factor(m, i, x).double()
                return out
            mix = sum(c[x] * b(n, [x] + rest) for x in range(V))
            torch.testing.assert_close(mix, b(n - 1, rest), rtol=1e-8, atol=1e-9)


def test_quotient_remainder_rows_are_distinct_and_seeded():
    rows = hash_rows(torch.arange(V), VP, 2, 0)
    assert len({tuple(r) for r in rows.tolist()}) == V and int(rows.max()) < VP
    a, b = hash_rows(torch.arange(V), VP, 4, 0), hash_rows(torch.arange(V), VP, 4, 0)
    assert torch.equal(a, b) and not torch.equal(a, hash_rows(torch.arange(V), VP, 4, 1))


def test_one_hash_over_the_whole_vocabulary_is_the_paper_module():
    """factor_rows = V, n_hashes = 1: h_1 is the identity, so A~ = A and the module is TN-gram's."""
    m = make(n_hashes=1, factor_rows=V)
    torch.manual_seed(0)
    paper = TNGramConfig(max_ngram=N, cp_rank=R, zero_init_value=False, zero_init_conv=False,
                         pad_id=PAD).build(d_model=D, vocab_size=V, layer_id=1, layer_ids=(1, 3))
    paper.load_state_dict(m.state_dict())
    ids, h = torch.randint(0, V, (2, 11)), torch.randn(2, 11, D)
    with torch.no_grad():
        torch.testing.assert_close(m(h, ids), paper(h, ids), rtol=1e-6, atol=1e-6)
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in paper.parameters())


@pytest.mark.parametrize("name", list(SETTINGS))
def test_param_count_equals_module(name):
    for layer in (1, 3):
        cfg = make(**SETTINGS[name]).config
        m = cfg.build(d_model=D, vocab_size=V, layer_id=layer, layer_ids=(1, 3))
        want = N * VP * R + (N * V * cfg.n_hashes if cfg.combine == "sum" else 0)
        assert sum(p.numel() for p in m.parameters()) == cfg.param_count(
            d_model=D, vocab_size=V, layer_id=layer, layer_ids=(1, 3))
        assert m.factors.numel() + (m.importance.numel() if m.importance is not None else 0) == want


@pytest.mark.parametrize("name", list(SETTINGS))
def test_module_causality(name):
    assert_causal(make(**SETTINGS[name]), V, D)


def tiny_gpt(memory, layers=(0, 1)) -> GPT:
    return variants_tiny_gpt(memory, layers, vocab_size=V)


def mem_cfg(name: str) -> TNGramHashedConfig:
    return TNGramHashedConfig(max_ngram=N, cp_rank=R, factor_rows=VP, zero_init_value=False,
                              zero_init_conv=False, **SETTINGS[name])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_gpt_decode_equals_full_forward_and_is_causal(name):
    model = tiny_gpt(mem_cfg(name))
    ids = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        full = model(ids)
        cache: dict = {}
        steps = [model(ids[:, :4], cache=cache)] + [model(ids[:, t:t + 1], cache=cache)
                                                     for t in range(4, 11)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
        ids2 = ids.clone()
        ids2[:, 6] = (ids2[:, 6] + 3) % V
        full2 = model(ids2)
    torch.testing.assert_close(full[:, :6], full2[:, :6], rtol=0, atol=0)
    assert not torch.allclose(full[:, 6:], full2[:, 6:])


@pytest.mark.parametrize("name", ["prod2", "sum2"])
def test_row_sparse_gradient_equals_dense(name):
    """sparse_grad (optim.memory_update sparse/rowwise): the pools' (and importance weights')
    gradients are row-sparse, touch only the rows read, and equal the dense gradient."""
    ids, h = torch.randint(0, V, (2, 9)), torch.randn(2, 9, D)
    grads = {}
    for sparse in (False, True):
        m = make(**SETTINGS[name])
        m.sparse_grad = sparse
        m(h, ids).square().sum().backward()
        grads[sparse] = [p.grad for p in m.table_parameters()]
    for d, s in zip(grads[False], grads[True]):
        assert s.is_sparse
        torch.testing.assert_close(s.to_dense(), d, rtol=1e-5, atol=1e-6)


def test_trains_with_sparse_memory_update(tmp_path, tiny_data):  # noqa: F811
    """A few steps of `tngram train` with optim.memory_update=sparse + catch-up: finite loss that
    falls, Δparams as counted."""
    from tngram.train.recipes import get_recipe, param_summary
    from tngram.train.loop import train

    base = get_recipe("mini-tngram")
    mem = TNGramHashedConfig(max_ngram=3, cp_rank=16, factor_rows=16, n_hashes=2)
    cfg = replace(base, model=replace(base.model, vocab_size=TINY_VOCAB, n_layer=2, n_embd=32,
                                      n_head=2, n_kv_head=1, sequence_len=64,
                                      memory_layers=(0, 1), memory=mem),
                  data=replace(base.data, dir=str(tiny_data), global_batch_tokens=4 * 64,
                               micro_batch_seqs=4, val_tokens=512),
                  schedule=replace(base.schedule, steps=12, warmdown_steps=4),
                  optim=replace(base.optim, memory_update="sparse", memory_catchup=True),
                  run=replace(base.run, checkpoint_every=0, log_every=4))
    summary = train(cfg, out_dir=tmp_path / "run")
    assert math.isfinite(summary["val_loss"]) and summary["delta_params"] == \
        param_summary(cfg)["delta_params"] == 2 * mem.param_count(d_model=32, vocab_size=TINY_VOCAB)


def test_hf_add_memory_causal_and_cached_generation():
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import VOCAB, prompt, tiny_model
    from tngram.hf import add_memory

    cfg = TNGramHashedConfig(max_ngram=3, cp_rank=8, factor_rows=8, n_hashes=2,
                             zero_init_value=False, zero_init_conv=False)
    plain = tiny_model("llama")
    model = add_memory(tiny_model("llama"), cfg, layers=(0, 2), memory_seed=1)
    assert sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in plain.parameters()) \
        == 2 * cfg.param_count(d_model=32, vocab_size=VOCAB)
    x = prompt(2, 10)
    y = x.clone()
    y[:, 6] = (x[:, 6] + 7) % (VOCAB - 1) + 1
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
        torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
        assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-4
        cached = model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        full = model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                              use_cache=False)
    assert torch.equal(cached, full)


def test_export_to_hf(tmp_path, tiny_data):  # noqa: F811
    """`tngram export RUN --hf DIR`: same tensors, same logits, cached greedy generation equals our
    full forward recomputed token by token."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from test_hf_export import assert_export_round_trip

    assert_export_round_trip(tmp_path, tiny_data, TNGramHashedConfig(
        max_ngram=3, cp_rank=8, factor_rows=8, n_hashes=2, combine="sum", zero_init_value=False,
        zero_init_conv=False))

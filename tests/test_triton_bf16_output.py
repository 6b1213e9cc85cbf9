"""Under bf16 autocast on CUDA the Triton lookup writes e in bf16 directly (kernels.policy
bf16_lookup_output): no fp32 e of (N-1) R features per token and no cast pass over it. It must be
the same computation: e bit-identical to the fp32 kernel's e cast to bf16 (the kernel rounds to
nearest-even, as torch's cast), and the factor, absorption and scale gradients from a bf16
upstream gradient bit-identical to those through the cast (whose backward upcasts the bf16
gradient exactly, as the kernel does on load). Checked under the Triton interpreter (a
subprocess, CPU tensors) for N 4 and 5, with and without norm, absorption and scales; the kernel
with a bf16 output also lowers to an sm_80 cubin; and the policy asks for bf16 on CUDA autocast.

For order_combine="sum" the Triton lookup also sums the orders in its epilogue (fused_lookup
sum_orders): one R-wide row per token instead of (N-1) R. The sum is fp32 in order 1..N-1, the
order torch's .sum over the orders of the fp32 e takes, so e (fp32, and rounded once to bf16)
and every gradient are bit-identical to summing the kernel's e in torch (the sum's backward hands
each order the same gradient row, which the kernel reads once per order). A TN-gram GPT with the
sum and the hashed orders gives the torch lookup's loss and gradients through it (module path).
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest
import torch

from triton_subprocess import Case, assert_lowers_to_sm80_cubin, run_under_interpreter

from tngram.kernels import kernel_policy, lookup_out_dtype
from tngram.kernels.choice import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

SCRIPT = textwrap.dedent("""
    import torch
    from tngram.kernels import fused_lookup
    from tngram.memory.ngrams import suffix_ngrams
    V, R = 11, 20
    checked = 0
    for N, use_norm, absorb, scales in ((4, True, True, True), (5, False, True, False)):
        g = torch.Generator().manual_seed(N)
        f = torch.randn(N, V, R, generator=g).requires_grad_()
        a = torch.randn(N - 2, R, generator=g).requires_grad_() if absorb and N > 2 else None
        l = (0.3 * torch.randn(N - 1, generator=g)).requires_grad_() if scales else None
        leaves = [p for p in (f, a, l) if p is not None]
        ng = suffix_ngrams(torch.randint(0, V, (1, 6), generator=g), N, pad_id=2)
        up = torch.randn(1, 6, (N - 1) * R, generator=g).bfloat16()
        direct = fused_lookup(f, a, l, ng, use_norm=use_norm, impl="triton",
                              out_dtype=torch.bfloat16)
        cast = fused_lookup(f, a, l, ng, use_norm=use_norm, impl="triton").to(torch.bfloat16)
        assert direct.dtype == torch.bfloat16, direct.dtype
        assert torch.equal(direct, cast), (N, (direct.float() - cast.float()).abs().max())
        g_direct = torch.autograd.grad(direct, leaves, up)
        g_cast = torch.autograd.grad(cast, leaves, up)
        for x, y in zip(g_direct, g_cast):
            assert x.dtype == y.dtype and torch.equal(x, y), (N, (x - y).abs().max())
            assert bool(x.ne(0).any())
        checked += 1
    print(checked)
""")

SUM_SCRIPT = textwrap.dedent("""
    import os, torch
    from tngram.kernels import fused_lookup
    from tngram.memory.ngrams import suffix_ngrams
    V, R = 11, 20
    checked = 0
    for N, use_norm, absorb, scales in ((5, True, True, True), (3, False, False, False)):
        g = torch.Generator().manual_seed(N)
        f = torch.randn(N, V, R, generator=g).requires_grad_()
        a = torch.randn(N - 2, R, generator=g).requires_grad_() if absorb and N > 2 else None
        l = (0.3 * torch.randn(N - 1, generator=g)).requires_grad_() if scales else None
        leaves = [p for p in (f, a, l) if p is not None]
        ng = suffix_ngrams(torch.randint(0, V, (1, 6), generator=g), N, pad_id=2)
        up = torch.randn(1, 6, R, generator=g)
        kw = dict(use_norm=use_norm, impl="triton")
        fused = fused_lookup(f, a, l, ng, sum_orders=True, **kw)
        summed = fused_lookup(f, a, l, ng, **kw).view(1, 6, N - 1, R).sum(-2)
        assert fused.shape == (1, 6, R) and torch.equal(fused, summed), N
        for x, y in zip(torch.autograd.grad(fused, leaves, up),
                        torch.autograd.grad(summed, leaves, up)):
            assert torch.equal(x, y) and bool(x.ne(0).any()), (N, (x - y).abs().max())
        lowp = fused_lookup(f, a, l, ng, sum_orders=True, out_dtype=torch.bfloat16, **kw)
        assert torch.equal(lowp, summed.to(torch.bfloat16)), N
        checked += 1
    # the module path: a TN-gram GPT with the orders summed and hashed orders, Triton vs torch
    from tngram.memory.tngram_variants import TNGramVariantConfig
    from tngram.model.gpt import GPT, GPTConfig
    mem = TNGramVariantConfig(max_ngram=3, cp_rank=12, order_combine="sum", hash_orders=(2, 3),
                              hash_embed=8, hash_heads=2, hash_budget=13)
    res = {}
    for impl in ("torch", "triton"):
        os.environ["TNGRAM_LOOKUP_IMPL"] = impl
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=32, n_layer=1, n_embd=16, n_head=2, n_kv_head=1,
                              sequence_len=8, memory=mem, memory_layers=(0,), memory_seed=0))
        tn = next(m for m in model.modules() if type(m).__name__ == "TNGramVariant")
        torch.nn.init.normal_(tn.fusion.value_proj.weight)  # not the zero init: e reaches the loss
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = model(ids, ids)
        loss.backward()
        res[impl] = (loss.item(), tn.factors.grad.clone())
    (l0, g0), (l1, g1) = res["torch"], res["triton"]
    assert abs(l0 - l1) <= 1e-5 * abs(l0), (l0, l1)
    scale = g0.abs().max().item()
    assert scale > 0 and (g0 - g1).abs().max().item() <= 2e-5 * max(1.0, scale)
    print(checked)
""")


@needs_triton
def test_triton_sums_the_orders_in_its_epilogue_with_the_same_numbers():
    lines = run_under_interpreter(SUM_SCRIPT)
    assert lines[-1] == "2"


@needs_triton
def test_triton_bf16_e_is_the_cast_of_the_fp32_e_with_the_same_gradients():
    lines = run_under_interpreter(SCRIPT)
    assert lines[-1] == "2"


@needs_triton
def test_triton_bf16_and_summed_outputs_compile_for_cuda_without_a_gpu():
    fwd = {"table_ptr": "*fp32", "idx_ptr": "*i64", "w_ptr": "*fp32", "s_ptr": "*fp32",
           "out_ptr": "*bf16", "rstd_ptr": "*fp32", "R": "i32", "eps": "fp32"}
    bwd = {"table_ptr": "*fp32", "idx_ptr": "*i64", "w_ptr": "*fp32", "s_ptr": "*fp32",
           "rstd_ptr": "*fp32", "grad_ptr": "*bf16", "dtable_ptr": "*fp32", "drows_ptr": "*fp32",
           "dw_ptr": "*fp32", "ds_ptr": "*fp32", "M": "i32", "R": "i32"}
    flags = {"N": 5, "HAS_W": True, "HAS_S": True, "USE_NORM": True, "BLOCK_R": 1024}
    cases: list[Case] = [("_tngram_fwd_kernel", fwd, {**flags, "SUM_ORDERS": s})
                         for s in (False, True)]
    cases.append(("_tngram_bwd_kernel", bwd, {**flags, "NEED_TABLE": True, "BLOCK_M": 16,
                                              "BLOCK_K": 4, "SUM_ORDERS": True, "ACC_WS": True,
                                              "ROWS_OUT": False}))
    assert_lowers_to_sm80_cubin("tngram.kernels.tngram_triton", cases)


def test_policy_asks_for_bf16_under_cuda_bf16_autocast(monkeypatch):
    """A CUDA h under bf16 autocast gets bf16 (the autocast state is stubbed: no GPU here); fp16
    autocast, autocast off, or the policy switched off get None (the factors' dtype)."""
    h = SimpleNamespace(device=torch.device("cuda"))
    state = {"on": True, "dtype": torch.bfloat16}
    monkeypatch.setattr(
        torch, "is_autocast_enabled", lambda dev=None: state["on"] and dev == "cuda"
    )
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda dev: state["dtype"])
    assert lookup_out_dtype(h) == torch.bfloat16
    with kernel_policy(bf16_lookup_output=False):
        assert lookup_out_dtype(h) is None
    state["dtype"] = torch.float16
    assert lookup_out_dtype(h) is None
    state.update(on=False, dtype=torch.bfloat16)
    assert lookup_out_dtype(h) is None

"""The fused TN-gram lookup (tngram.kernels) against the plain-autograd reference (memory/cp.py).

Forward values and the gradients of factors, absorption vectors and log-scales are compared for
N = 2..8, every ablation switch, padding, chunk boundaries, fp32 and bf16, for the CPU torch path,
the C kernel (fp32; skipped only when no C compiler works) and (under the Triton interpreter, in
a subprocess) for the Triton kernels.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tngram.kernels import (absorption_weights, c_unavailable_reason, fused_lookup, kernel_policy,
                            ngram_row_index, resolved_impl, triton_available)
from tngram.memory.cp import absorption_products, order_embeddings, order_vectors
from tngram.memory.ngrams import suffix_ngrams
from tngram.memory.tngram import TNGramConfig

ROOT = Path(__file__).resolve().parents[1]
V, R = 13, 24
CPU_IMPLS = ["torch", pytest.param("c", marks=pytest.mark.skipif(
    c_unavailable_reason() is not None, reason=f"C kernel unavailable: {c_unavailable_reason()}"))]

# fp32: both paths do the same products and one mean over R per order, in a different order of
# operations, so they differ by a few fp32 ulps (1.2e-7) of the tensor's largest magnitude (sums
# over tokens of products of up to 8 factors). Allowed: 2e-5 x max(1, max |reference|), >10x room.
F32_REL = 2e-5


def assert_close_scaled(got: torch.Tensor, ref: torch.Tensor, rel: float = F32_REL,
                        what: str = "") -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype, (what, got.shape, ref.shape)
    scale = max(1.0, ref.abs().max().item())
    err = (got - ref).abs().max().item()
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel:g} x {scale:.3g}"


def params(N: int, dtype: torch.dtype = torch.float32, absorb: bool = True, scales: bool = True,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(N, V, R, generator=g).to(dtype).requires_grad_()
    a = (torch.randn(N - 2, R, generator=g).to(dtype).requires_grad_()
         if absorb and N > 2 else None)
    l = (0.3 * torch.randn(N - 1, generator=g)).to(dtype).requires_grad_() if scales else None
    return f, a, l


def reference(f, a, l, ngrams, use_norm=True):
    return order_embeddings(order_vectors(f, a, ngrams), l, use_norm)


def value_and_grads(fn, f, a, l, upstream):
    out = fn()
    leaves = [p for p in (f, a, l) if p is not None]
    return out, torch.autograd.grad(out, leaves, upstream)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("N", range(2, 9))
def test_fp32_forward_and_grads_match_reference(N, impl):
    f, a, l = params(N, seed=N)
    ids = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(N))
    ng = suffix_ngrams(ids, N, pad_id=0)
    up = torch.randn(3, 11, (N - 1) * R)
    ref, ref_g = value_and_grads(lambda: reference(f, a, l, ng), f, a, l, up)
    got, got_g = value_and_grads(lambda: fused_lookup(f, a, l, ng, impl=impl, chunk=4),
                                 f, a, l, up)
    assert_close_scaled(got, ref, what="e")
    for x, y, name in zip(got_g, ref_g, ("factors", "absorb", "log_scales")):
        assert_close_scaled(x, y, what=name)


@pytest.mark.parametrize("use_norm", [True, False])
@pytest.mark.parametrize("learn_scales", [True, False])
@pytest.mark.parametrize("use_absorption", [True, False])
@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_module_switch_every_ablation_matches_reference(use_norm, learn_scales, use_absorption,
                                                        impl, monkeypatch):
    """TNGram(fused=True) == TNGram(fused=False): output y and every parameter gradient."""
    monkeypatch.setenv("TNGRAM_LOOKUP_IMPL", impl)
    kw = dict(max_ngram=4, cp_rank=R, use_norm=use_norm, learn_scales=learn_scales,
              use_absorption=use_absorption, zero_init_value=False, zero_init_conv=False)
    torch.manual_seed(0)
    fused = TNGramConfig(fused=True, **kw).build(d_model=16, vocab_size=V)
    ref = TNGramConfig(fused=False, **kw).build(d_model=16, vocab_size=V)
    ref.load_state_dict(fused.state_dict())
    with torch.no_grad():  # non-trivial absorption and scales
        for m in (fused, ref):
            if m.absorb is not None:
                m.absorb.copy_(torch.linspace(-1.5, 1.5, m.absorb.numel()).view_as(m.absorb))
            if m.log_scales is not None:
                m.log_scales.copy_(torch.tensor([0.2, -0.3, 0.1]))
    ids = torch.randint(0, V, (2, 9))
    h = torch.randn(2, 9, 16)
    for m in (fused, ref):
        m(h, ids).square().sum().backward()
    assert_close_scaled(fused(h, ids), ref(h, ids), what="y")
    for (name, p), (_, q) in zip(fused.named_parameters(), ref.named_parameters()):
        assert_close_scaled(p.grad, q.grad, what=name)


@pytest.mark.parametrize("N", [2, 5, 8])
def test_bf16_is_at_least_as_accurate_as_the_bf16_reference(N):
    """bf16 parameters: the fused path computes in fp32 and rounds once. Against an fp64 evaluation
    of the same bf16 numbers every output and gradient must be within bf16 rounding (2^-8 = 0.4%
    relative per rounding, a few roundings on the log-scale path through autograd's bf16 exp:
    allowed 1e-2 of the largest magnitude), and on e and the factor gradient (many elements, a
    stable statistic) the mean error must not exceed the all-bf16 reference's."""
    f, a, l = params(N, torch.bfloat16, seed=10 + N)
    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(N))
    ng = suffix_ngrams(ids, N, pad_id=1)
    up = torch.randn(2, 10, (N - 1) * R, generator=torch.Generator().manual_seed(N)).bfloat16()
    f64 = [None if p is None else p.detach().double().requires_grad_() for p in (f, a, l)]
    truth, truth_g = value_and_grads(lambda: reference(*f64, ng), *f64, up.double())
    ref, ref_g = value_and_grads(lambda: reference(f, a, l, ng), f, a, l, up)
    got, got_g = value_and_grads(lambda: fused_lookup(f, a, l, ng, impl="torch", chunk=7),
                                 f, a, l, up)
    assert got.dtype == torch.bfloat16 and all(x.dtype == torch.bfloat16 for x in got_g)
    for i, (x, r, t) in enumerate(zip((got, *got_g), (ref, *ref_g), (truth, *truth_g))):
        scale = t.abs().max().item()
        err_got = (x.double() - t).abs()
        assert err_got.max().item() <= 1e-2 * scale, (i, err_got.max().item(), scale)
        if i < 2:  # e and d factors
            assert err_got.mean() <= (r.double() - t).abs().mean(), i


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_padding_short_sequences_and_pad_row_gradient(impl):
    """T < N (every position padded), a non-zero pad id; the pad row gets exactly the reference's
    gradient and rows of absent tokens get none."""
    N, pad = 6, 5
    f, a, l = params(N, seed=3)
    ids = torch.tensor([[1, 2, 3], [2, 2, 7]])
    ng = suffix_ngrams(ids, N, pad_id=pad)
    up = torch.randn(2, 3, (N - 1) * R)
    ref, ref_g = value_and_grads(lambda: reference(f, a, l, ng), f, a, l, up)
    got, got_g = value_and_grads(lambda: fused_lookup(f, a, l, ng, impl=impl), f, a, l, up)
    assert_close_scaled(got, ref, what="e")
    for x, y, name in zip(got_g, ref_g, ("factors", "absorb", "log_scales")):
        assert_close_scaled(x, y, what=name)
    touched = got_g[0].abs().sum(dim=(0, 2)) > 0
    assert set(torch.nonzero(touched).flatten().tolist()) == {1, 2, 3, 7, pad}


def test_chunking_does_not_change_results_and_no_grad_works():
    N = 5
    f, a, l = params(N, seed=4)
    ng = suffix_ngrams(torch.randint(0, V, (3, 17)), N, pad_id=0)
    outs = [fused_lookup(f, a, l, ng, impl="torch", chunk=c) for c in (1, 5, 51, 1000)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(fused_lookup(f, a, l, ng, impl="torch"), outs[0], rtol=0, atol=0)
        assert_close_scaled(fused_lookup(f, a, l, ng), outs[0], what="auto impl under no_grad")


def test_index_and_absorption_helpers_match_reference():
    N = 5
    f, a, _ = params(N)
    ng = suffix_ngrams(torch.randint(0, V, (2, 6)), N, pad_id=0)
    rows = f.reshape(N * V, R)[ngram_row_index(ng, V)]                    # (M, N, R)
    # column k (token x_{t-k}) reads A_{N-k} = factors[N-1-k]
    expect = torch.stack([f[N - 1 - k][ng[..., k].reshape(-1)] for k in range(N)], dim=1)
    torch.testing.assert_close(rows, expect, rtol=0, atol=0)
    torch.testing.assert_close(absorption_weights(a, N, R, f), absorption_products(a, N, R, f))
    assert absorption_weights(None, N, R, f) is None


def test_kernels_import_nothing_from_memory_or_model_and_not_triton():
    banned = ("tngram.memory", "tngram.model", "tngram.train", "research.bench")
    for path in sorted((ROOT / "tngram" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not any(m.startswith(banned) for m in mods), (path.name, mods)
    code = "import sys, tngram.kernels, tngram.memory.tngram; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


TRITON_SCRIPT = textwrap.dedent("""
    import torch
    from tngram.kernels import fused_lookup
    from tngram.memory.cp import order_embeddings, order_vectors
    from tngram.memory.ngrams import suffix_ngrams
    V, R = 11, 20          # R not a power of two: exercises the lane masks
    cases = [(N, True, True, True) for N in (2, 5, 8)]
    cases += [(4, False, True, True), (4, True, False, False), (4, False, False, False)]
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        for N, use_norm, scales, absorb in cases:
            if dtype == torch.bfloat16 and N != 5:
                continue
            g = torch.Generator().manual_seed(N)
            f = torch.randn(N, V, R, generator=g).to(dtype).requires_grad_()
            a = torch.randn(N - 2, R, generator=g).to(dtype).requires_grad_() if absorb and N > 2 else None
            l = (0.3 * torch.randn(N - 1, generator=g)).to(dtype).requires_grad_() if scales else None
            ng = suffix_ngrams(torch.randint(0, V, (2, 9), generator=g), N, pad_id=2)
            up = torch.randn(2, 9, (N - 1) * R, generator=g).to(dtype)
            leaves = [p for p in (f, a, l) if p is not None]
            f64 = [p.detach().double().requires_grad_() for p in leaves]
            it = iter(f64)
            args = [next(it) if p is not None else None for p in (f, a, l)]
            ref = order_embeddings(order_vectors(args[0], args[1], ng), args[2], use_norm)
            ref_g = torch.autograd.grad(ref, f64, up.double())
            got = fused_lookup(f, a, l, ng, use_norm=use_norm, impl="triton")
            got_g = torch.autograd.grad(got, leaves, up)
            for x, t in zip((got, *got_g), (ref, *ref_g)):
                rel = ((x.double() - t).abs().max() / t.abs().max().clamp_min(1e-12)).item()
                key = str(dtype)
                worst[key] = max(worst.get(key, 0.0), rel)
    print(worst["torch.float32"], worst["torch.bfloat16"])
""")


@pytest.mark.skipif(not triton_available(),
                    reason="triton is not installed (pip install triton); the Triton kernels "
                           "are checked under TRITON_INTERPRET=1")
def test_triton_kernels_match_reference_under_interpreter():
    """Triton forward/backward vs an fp64 reference: fp32 within 1e-5 relative to the largest
    magnitude (fp32 compute, reductions over R <= 32 terms), bf16 within 1e-2 (bf16 rounding of
    inputs, output and gradients, 2^-8 relative)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    err32, err16 = map(float, out.stdout.split())
    assert err32 < 1e-5, err32
    assert err16 < 1e-2, err16


TRITON_SPLIT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import tngram.kernels.tngram_triton as tt
    # a spy on the sorted backward's per-row sum (the real one runs): which path ran
    sums, real_sum = [], tt.sum_rows_sorted
    tt.sum_rows_sorted = lambda *a: (sums.append(1), real_sum(*a))[1]
    from tngram.kernels import fused_lookup, kernel_policy
    from tngram.memory.cp import order_embeddings, order_vectors
    from tngram.memory.ngrams import suffix_ngrams
    V, R = 11, 20
    # (N, use_norm, scales, absorb, orders summed, dtype); 2 x 70 tokens: three programs of the
    # split backward's dW / ds kernel per order (64 tokens each), the last one partly dead
    cases = [(5, True, True, True, False, torch.float32), (5, True, True, True, True, torch.float32),
             (4, False, True, True, True, torch.float32), (3, True, False, False, False, torch.float32),
             (5, True, True, True, True, torch.bfloat16)]
    worst = {}
    for N, use_norm, scales, absorb, summed, dtype in cases:
        g = torch.Generator().manual_seed(N)
        f = torch.randn(N, V, R, generator=g).to(dtype).requires_grad_()
        a = torch.randn(N - 2, R, generator=g).to(dtype).requires_grad_() if absorb else None
        l = (0.3 * torch.randn(N - 1, generator=g)).to(dtype).requires_grad_() if scales else None
        ng = suffix_ngrams(torch.randint(0, V, (2, 70), generator=g), N, pad_id=2)
        up = torch.randn(2, 70, R if summed else (N - 1) * R, generator=g).to(dtype)
        leaves = [p for p in (f, a, l) if p is not None]
        f64 = [p.detach().double().requires_grad_() for p in leaves]
        it = iter(f64)
        args = [next(it) if p is not None else None for p in (f, a, l)]
        ref = order_embeddings(order_vectors(args[0], args[1], ng), args[2], use_norm)
        if summed:
            ref = ref.unflatten(-1, (N - 1, R)).sum(-2)
        ref_g = torch.autograd.grad(ref, f64, up.double())
        with kernel_policy(triton_backward=sys.argv[1], triton_backward_warps=8):
            got = fused_lookup(f, a, l, ng, use_norm=use_norm, impl="triton", sum_orders=summed)
        got_g = torch.autograd.grad(got, leaves, up)
        assert len(got_g) == len(ref_g) == len(leaves)
        for x, t in zip((got, *got_g), (ref, *ref_g)):
            rel = ((x.double() - t).abs().max() / t.abs().max().clamp_min(1e-12)).item()
            worst[str(dtype)] = max(worst.get(str(dtype), 0.0), rel)
    print(worst["torch.float32"], worst["torch.bfloat16"], len(sums))
""")


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install triton)")
@pytest.mark.parametrize("backward", ["split", "sorted"])
def test_triton_split_and_sorted_backwards_match_reference_under_interpreter(backward):
    """kernel_policy(triton_backward="split"): the rows kernel without its dW / ds tile plus the
    per-order dW / ds kernel; "sorted": the rows kernel storing each token's row gradients and
    a sort-based sum per row. Both give the fp64 reference's gradients, with the tolerances of
    the fused backward's test above (concatenated and summed orders, with and without norm,
    absorption and scales; more tokens than one dW / ds program holds; rows read by many
    tokens: V 11, 140 tokens)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", TRITON_SPLIT_SCRIPT, backward], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    err32, err16, sums = map(float, out.stdout.split())
    assert err32 < 1e-5, err32
    assert err16 < 1e-2, err16
    # the sorted path ran once per case's backward (5 cases), and never for split
    assert sums == (5 if backward == "sorted" else 0), sums


def test_kernel_policy_rejects_unknown_triton_backwards():
    with pytest.raises(ValueError, match="triton_backward must be one of"):
        with kernel_policy(triton_backward="tiled"):
            pass
    with pytest.raises(ValueError, match="triton_backward_warps"):
        with kernel_policy(triton_backward_warps=6):
            pass


COMPILE_SCRIPT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from tngram.kernels import tngram_triton as k
    ptr = lambda names: {n: "*i64" if n == "idx_ptr" else "*fp32" for n in names}
    fwd = {**ptr(["table_ptr", "idx_ptr", "w_ptr", "s_ptr", "out_ptr", "rstd_ptr"]), "R": "i32",
           "eps": "fp32"}
    bwd = {**ptr(["table_ptr", "idx_ptr", "w_ptr", "s_ptr", "rstd_ptr", "grad_ptr", "dtable_ptr",
                  "drows_ptr", "dw_ptr", "ds_ptr"]), "M": "i32", "R": "i32"}
    flags = {"N": 5, "HAS_W": True, "HAS_S": True, "USE_NORM": True, "BLOCK_R": 1024,
             "SUM_ORDERS": False}
    ws = {n: t for n, t in bwd.items() if n not in ("dtable_ptr", "drows_ptr")}
    rows = {"NEED_TABLE": True, "BLOCK_M": 16, "BLOCK_K": 4, "ACC_WS": True, "ROWS_OUT": False}
    for fn, sig, extra in ((k._tngram_fwd_kernel, fwd, {}),
                           (k._tngram_bwd_kernel, bwd, rows),
                           (k._tngram_bwd_kernel, bwd, {**rows, "ACC_WS": False}),
                           (k._tngram_bwd_kernel, bwd, {**rows, "ROWS_OUT": True}),
                           (k._tngram_bwd_ws_kernel, ws, {"BLOCK_M": 64})):
        const = {**flags, **extra}
        src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const)
        assert "cubin" in triton.compile(src, target=GPUTarget("cuda", 80, 32), options={"num_warps": 4}).asm
    print("ok")
""")


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install triton)")
def test_triton_kernels_compile_for_cuda_without_a_gpu():
    """The interpreter accepts code the GPU compiler rejects (e.g. non-constexpr loop bounds), so
    the kernels (forward, fused backward, the split backward's two, the sorted backward's rows
    kernel) are also lowered to a cubin for sm_80 (triton's bundled ptxas, no device)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_impl_environment_override(monkeypatch):
    f, a, l = params(3)
    ng = suffix_ngrams(torch.randint(0, V, (1, 5)), 3, pad_id=0)
    monkeypatch.setenv("TNGRAM_LOOKUP_IMPL", "torch")
    assert_close_scaled(fused_lookup(f, a, l, ng), reference(f, a, l, ng), what="e")
    assert resolved_impl("cpu") == "torch (TNGRAM_LOOKUP_IMPL)"
    monkeypatch.setenv("TNGRAM_LOOKUP_IMPL", "cuda-please")
    with pytest.raises(ValueError, match="TNGRAM_LOOKUP_IMPL"):
        fused_lookup(f, a, l, ng)


def test_intra_op_thread_count_is_restored():
    """The CPU op runs its chunk loop single-threaded and must hand the thread count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        f, a, l = params(4)
        ng = suffix_ngrams(torch.randint(0, V, (2, 6)), 4, pad_id=0)
        fused_lookup(f, a, l, ng).sum().backward()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(c_unavailable_reason() is not None, reason="C kernel unavailable")
def test_c_kernel_rejects_out_of_range_ids_and_non_fp32():
    """The C loop has no bounds checks, so the wrapper must refuse ids outside [0, V)."""
    f, a, l = params(3)
    ng = suffix_ngrams(torch.randint(0, V, (1, 5)), 3, pad_id=0)
    bad = ng.clone()
    bad[0, 2, 1] = V
    with pytest.raises(ValueError, match=r"\[0, 13\)"):
        fused_lookup(f, a, l, bad, impl="c")
    with pytest.raises(ValueError, match="fp32 CPU"):
        fused_lookup(*params(3, torch.bfloat16), ng, impl="c")
    # "auto" sends bf16 factors to the torch path: identical to forcing it
    fb, ab, lb = params(3, torch.bfloat16)
    torch.testing.assert_close(fused_lookup(fb, ab, lb, ng), fused_lookup(fb, ab, lb, ng, impl="torch"),
                               rtol=0, atol=0)


def test_without_a_c_compiler_auto_falls_back_to_torch(monkeypatch, tmp_path):
    """No compiler: "auto" runs the torch path (bit-identical to it), "c" errors saying why."""
    import tngram.kernels.choice as choice
    import tngram.kernels.tngram_c as tc
    monkeypatch.setattr(tc, "_STATE", {})
    monkeypatch.setattr(choice, "_CHOICE", {})       # forget this process's earlier choice
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    monkeypatch.setenv("TNGRAM_CACHE", str(tmp_path))
    monkeypatch.delenv("TNGRAM_LOOKUP_IMPL", raising=False)
    assert "no-such-compiler-xyz" in tc.c_unavailable_reason()
    assert resolved_impl("cpu").startswith("torch (C kernel unavailable")  # recorded in env.json
    assert resolved_impl("cpu", torch.bfloat16) == "torch (torch.bfloat16 factors)"
    f, a, l = params(4)
    ng = suffix_ngrams(torch.randint(0, V, (2, 6)), 4, pad_id=0)
    torch.testing.assert_close(fused_lookup(f, a, l, ng), fused_lookup(f, a, l, ng, impl="torch"),
                               rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="C lookup is unavailable"):
        fused_lookup(f, a, l, ng, impl="c")


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_module_under_torch_compile_matches_eager(impl, monkeypatch):
    """torch.compile traces with fake tensors (no data): the C op must run outside the graph, not
    read their null pointers (that segfaulted before). aot_eager: dynamo + autograd tracing
    without Inductor's C++ build, so the test stays fast."""
    monkeypatch.setenv("TNGRAM_LOOKUP_IMPL", impl)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = TNGramConfig(max_ngram=4, cp_rank=R, zero_init_value=False, zero_init_conv=False).build(d_model=16, vocab_size=V)
    ids = torch.randint(0, V, (2, 9))
    h = torch.randn(2, 9, 16)
    y_ref = m(h, ids)
    g_ref = torch.autograd.grad(y_ref.square().sum(), list(m.parameters()))
    y = torch.compile(m, backend="aot_eager")(h, ids)
    g = torch.autograd.grad(y.square().sum(), list(m.parameters()))
    assert_close_scaled(y, y_ref, what="y")
    for (name, _), x, r in zip(m.named_parameters(), g, g_ref):
        assert_close_scaled(x, r, what=name)


@pytest.mark.skipif(c_unavailable_reason() is not None, reason="C kernel unavailable")
def test_c_kernel_is_bit_identical_for_any_thread_count():
    """Tokens split between threads for their terms, the gradient adds owned by rows (id %
    threads) and dW columns, in token order: the same bits at 1, 2, 3 and 5 threads (R = 24 is
    two dW column blocks of 16, so at 3 and 5 threads some threads add no dW; M = 300 tokens are
    3 steps of 128 at 2 threads, 2 of 192 at 3), with repeated rows (V = 13)."""
    before = torch.get_num_threads()
    f, a, l = params(5)
    ng = suffix_ngrams(torch.randint(0, V, (3, 100), generator=torch.Generator().manual_seed(5)), 5, 0)
    up = torch.randn(3, 100, 4 * R, generator=torch.Generator().manual_seed(6))
    got = {}
    try:
        for nt in (1, 2, 3, 5):
            torch.set_num_threads(nt)
            got[nt] = value_and_grads(lambda: fused_lookup(f, a, l, ng, impl="c"), f, a, l, up)
    finally:
        torch.set_num_threads(before)
    e1, g1 = got[1]
    for nt in (2, 3, 5):
        e, g = got[nt]
        assert torch.equal(e, e1) and all(torch.equal(x, y) for x, y in zip(g, g1)), nt
    assert_close_scaled(e1, reference(f, a, l, ng), what="e")

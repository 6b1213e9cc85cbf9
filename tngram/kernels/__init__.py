"""Fused kernels: the TN-gram lookup (paper Eqs. 10-11) as one autograd op.

    fused_lookup(factors, absorb, log_scales, ngrams) -> e_concat (B, T, (N-1) R)

impl="auto" uses the Triton kernels on CUDA when triton is importable; on CPU with fp32 factors
the C kernel (`tngram_lookup.c`, built on first use by `tngram_c.py`, OpenMP over tokens) when a
C compiler works; else the torch path (`tngram_lookup.py`: chunked torch ops with a hand-written
backward, any device and dtype). A compiled kernel is used only after its first-use self-check
against the plain torch computation passed in this process (`choice.py`); otherwise "auto" warns
once and runs the torch path. "torch", "c" and "triton" force one; "triton" also runs on CPU
tensors under the Triton interpreter (TRITON_INTERPRET=1).
The environment variable TNGRAM_LOOKUP_IMPL (auto | torch | c | triton) overrides "auto", and so
does `kernel_policy(lookup_impl=...)` (`policy.py`: the one place for kernel and dtype choices).

torch.compile: the C and Triton kernels are torch.library custom ops (opaque to dynamo, with
fake implementations), the choice is a traced constant, and the torch path becomes plain torch
ops (`plain_lookup`), so a model compiles to one graph (tests/test_compile.py).
The plain-autograd reference is `tngram.memory.cp` (kernels never import memory/model).

Also here: row-sparse gradients (`sparse_rows.py`) and the row-sparse table updates' Triton kernel
with its choice and self-check (`row_update.py`, `row_update_triton.py`; used by
tngram.optim.memory_update's LazyAdam / RowwiseAdam on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tngram.kernels.choice import (
    IMPL_FNS,
    IMPLS,
    choose_impl,
    forced_impl,
    reset_choices,
    resolved_impl,
    self_check,
    self_check_results,
    triton_available,
)
from tngram.kernels.policy import (
    KernelPolicy,
    current_policy,
    kernel_policy,
    lookup_out_dtype,
    lookup_output_for,
)
from tngram.kernels.sparse_rows import compact_rows, host_read
from tngram.kernels.tngram_c import c_supported, c_unavailable_reason
from tngram.kernels.tngram_lookup import (
    DEFAULT_CHUNK_TOKENS,
    absorption_weights,
    clear_workspaces,
    ngram_row_index,
    plain_lookup,
)


def fused_lookup(
    factors: Tensor,
    absorb: Tensor | None,
    log_scales: Tensor | None,
    ngrams: Tensor,
    *,
    use_norm: bool = True,
    eps: float = 1e-6,
    impl: str = "auto",
    chunk: int = DEFAULT_CHUNK_TOKENS,
    out_dtype: torch.dtype | None = None,
    sparse_grad: bool = False,
    sum_orders: bool = False,
) -> Tensor:
    """e_concat (B, T, (N-1) R) = concat_n exp(l_n) RMSNorm(b_n), b_n from Eq. 10.

    factors (N, V, R); absorb (N-2, R) or None; log_scales (N-1,) or None; ngrams (B, T, N)
    suffix n-grams with column k = x_{t-k} (left-padded). use_norm=False drops the RMSNorm.
    out_dtype: the dtype the caller will cast e to (bf16 under autocast). A kernel that can
    write it directly (the C kernel, bf16) does, bit-identical to the cast and without the
    fp32 tensor; otherwise e comes back in the factors' dtype as usual and the caller casts.
    sparse_grad: the factors get a sparse COO gradient holding only the rows this batch reads
    (`tngram.kernels.sparse_rows`); the kernel runs on the compacted rows, same numbers.
    Factors on another device than the ngrams (tngram.hf table_device="cpu"): the rows read
    are gathered there and moved to the ngrams' device, the kernel runs there on them; the
    gradient flows back to the factors (dense, or row-sparse with sparse_grad); same numbers.
    sum_orders: return sum_n e_n (B, T, R) (TN-gram's order_combine="sum"). The Triton kernel
    sums in its epilogue in fp32 (orders 1..N-1 in order) and rounds once to out_dtype: no
    (N-1) R-wide e is written, and the value is torch's fp32 sum of the fp32 e (the K/V matmul
    under autocast rounds it the same way). The other kernels sum their e (B, T, N-1, R) in
    the dtype they return it in, as the caller did before (same numbers on the CPU).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    N, V, R = factors.shape
    B, T, n_cols = ngrams.shape
    if n_cols != N:
        raise ValueError(f"ngrams have {n_cols} columns, factors have N = {N}")
    idx = ngram_row_index(ngrams, V)  # (M, N)
    if sparse_grad or host_read(factors, idx):
        # the kernel sees (N, U'/N, R): the touched rows only, ids remapped (factors kept on
        # another device: those rows gathered there and moved to the ids' device)
        sub, idx = compact_rows(factors, idx, blocks=N, sparse=sparse_grad)
        factors = sub.view(N, -1, R)
    if impl == "auto":  # the policy's choice, else TNGRAM_LOOKUP_IMPL, else the self-checked kernel
        impl = current_policy().lookup_impl or "auto"
        if impl == "auto":
            impl = choose_impl(factors.device.type, str(factors.dtype))
    # the tiny W and s are built in (at least) fp32 with ordinary autograd; their bf16 gradients
    # are rounded once, at the cast back
    up = lambda p: p.float() if p.dtype in (torch.bfloat16, torch.float16) else p
    a = None if absorb is None else up(absorb)
    W = absorption_weights(a, N, R, factors if a is None else a)  # (N-1, R) | None
    scales = torch.exp(up(log_scales)) if log_scales is not None else None  # (N-1,) | None
    args = (idx, W, scales, use_norm, eps, max(1, int(chunk)))
    if impl == "c" and not c_supported(factors):
        raise ValueError(
            f"impl='c' needs fp32 CPU factors, got {factors.dtype} on {factors.device}"
        )
    if impl == "torch" and torch.compiler.is_compiling():
        e = plain_lookup(factors, *args)  # traceable ops
    else:
        fn = IMPL_FNS[impl]
        kw: dict[str, Any] = {}
        if out_dtype is not None and out_dtype in getattr(fn, "out_dtypes", ()):
            kw["out_dtype"] = out_dtype  # e comes back in out_dtype
        if sum_orders and getattr(fn, "sums_orders", False):
            return fn(factors, *args, sum_orders=True, **kw).view(B, T, R)
        e = fn(factors, *args, **kw)  # (M, N-1, R)
    if sum_orders:
        return e.view(B, T, N - 1, R).sum(-2)
    return e.view(B, T, (N - 1) * R)


__all__ = [
    "IMPLS",
    "DEFAULT_CHUNK_TOKENS",
    "absorption_weights",
    "c_unavailable_reason",
    "choose_impl",
    "clear_workspaces",
    "forced_impl",
    "fused_lookup",
    "ngram_row_index",
    "plain_lookup",
    "reset_choices",
    "resolved_impl",
    "self_check",
    "self_check_results",
    "triton_available",
    "KernelPolicy",
    "current_policy",
    "kernel_policy",
    "lookup_out_dtype",
    "lookup_output_for",
]

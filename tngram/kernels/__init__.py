"""Fused kernels: the TN-gram lookup (paper Eqs. 10-11) as one autograd op.

    fused_lookup(factors, absorb, log_scales, ngrams) -> e_concat (B, T, (N-1) R)

impl="auto" uses the Triton kernels on CUDA when triton is importable; on CPU with fp32 factors
the C kernel (`tngram_lookup.c`, built on first use by `tngram_c.py`) when a C compiler works;
else the torch path (`tngram_lookup.py`: chunked torch ops with a hand-written backward, any
device and dtype). "torch", "c" and "triton" force one; "triton" also runs on CPU tensors under
the Triton interpreter (TRITON_INTERPRET=1).
The environment variable TNGRAM_LOOKUP_IMPL (auto | torch | c | triton) overrides "auto", e.g. to
fall back to the torch path on a GPU (the Triton kernels are compiled and interpreter-checked
here, but were not run on GPU hardware).
The plain-autograd reference is `tngram.memory.cp` (kernels never import memory/model).
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from tngram.kernels.tngram_c import c_lookup, c_supported, c_unavailable_reason
from tngram.kernels.tngram_lookup import (DEFAULT_CHUNK_TOKENS, FusedTNGramLookup,
                                          absorption_weights, clear_workspaces,
                                          ngram_row_index)

IMPLS = ("auto", "torch", "c", "triton")


def triton_available() -> bool:
    """True when the `triton` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def resolved_impl(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Which path impl="auto" takes for factors on `device`/`dtype` (for run provenance)."""
    impl = os.environ.get("TNGRAM_LOOKUP_IMPL", "auto")
    if impl != "auto":
        return f"{impl} (TNGRAM_LOOKUP_IMPL)"
    if torch.device(device).type == "cuda":
        return "triton" if triton_available() else "torch (triton not installed)"
    if dtype != torch.float32:
        return f"torch ({dtype} factors)"
    reason = c_unavailable_reason()
    return "c" if reason is None else f"torch (C kernel unavailable: {reason[:200]})"


def fused_lookup(factors: Tensor, absorb: Tensor | None, log_scales: Tensor | None,
                  ngrams: Tensor, *, use_norm: bool = True, eps: float = 1e-6,
                  impl: str = "auto", chunk: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """e_concat (B, T, (N-1) R) = concat_n exp(l_n) RMSNorm(b_n), b_n from Eq. 10.

    factors (N, V, R); absorb (N-2, R) or None; log_scales (N-1,) or None; ngrams (B, T, N)
    suffix n-grams with column k = x_{t-k} (left-padded). use_norm=False drops the RMSNorm.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    N, V, R = factors.shape
    B, T, n_cols = ngrams.shape
    if n_cols != N:
        raise ValueError(f"ngrams have {n_cols} columns, factors have N = {N}")
    if impl == "auto":
        impl = os.environ.get("TNGRAM_LOOKUP_IMPL", "auto")
        if impl not in IMPLS:
            raise ValueError(f"TNGRAM_LOOKUP_IMPL must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if factors.is_cuda:
            impl = "triton" if triton_available() else "torch"
        else:
            impl = "c" if c_supported(factors) and c_unavailable_reason() is None else "torch"
    idx = ngram_row_index(ngrams, V)                                     # (M, N)
    # the tiny W and s are built in (at least) fp32 with ordinary autograd; their bf16 gradients
    # are rounded once, at the cast back
    up = (lambda p: p.float() if p.dtype in (torch.bfloat16, torch.float16) else p)
    a = None if absorb is None else up(absorb)
    W = absorption_weights(a, N, R, factors if a is None else a)         # (N-1, R) | None
    scales = torch.exp(up(log_scales)) if log_scales is not None else None   # (N-1,) | None
    args = (idx, W, scales, use_norm, eps, max(1, int(chunk)))
    if impl == "c":
        if not c_supported(factors):
            raise ValueError(f"impl='c' needs fp32 CPU factors, got {factors.dtype} on {factors.device}")
        e = c_lookup(factors, *args)                                     # (M, N-1, R)
    elif impl == "triton":
        from tngram.kernels.tngram_triton import TritonTNGramLookup
        e = TritonTNGramLookup.apply(factors, *args)
    else:
        e = FusedTNGramLookup.apply(factors, *args)
    return e.view(B, T, (N - 1) * R)


__all__ = ["IMPLS", "DEFAULT_CHUNK_TOKENS", "absorption_weights", "c_unavailable_reason", "clear_workspaces",
           "fused_lookup", "ngram_row_index", "resolved_impl", "triton_available"]

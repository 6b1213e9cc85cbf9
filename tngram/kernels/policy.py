"""Kernel and dtype policy: the one place that decides how a memory's forward runs, not what it
computes. Every setting gives the same numbers (bit-identical, or equal up to summation order for
fuse_kv and triton_backward); the defaults are the fastest measured (research/PERFORMANCE.md; on a
GPU, docs/GPU.md), and benchmarks and tests change them only through `kernel_policy(...)`, never
by setting attributes on modules.

    lookup_impl          "auto" | "torch" | "c" | "triton": the TN-gram lookup kernel
                         (tngram.kernels.fused_lookup). Default: the environment variable
                         TNGRAM_LOOKUP_IMPL, else "auto" (a compiled kernel after its self-check).
    bf16_lookup_output   under CPU or CUDA bf16 autocast the lookup writes e in bf16 directly
                         (e's only consumer is the K/V matmul, which autocast runs in bf16
                         anyway): no fp32 copy of e and no cast pass (the C kernel on CPU, the
                         Triton kernel on CUDA; bit-identical to the cast). Default True.
    triton_backward      "fused" | "split" | "sorted": how the Triton lookup's backward runs
                         (tngram.kernels.tngram_triton). For the absorption and scale
                         gradients, "fused" (default): in the rows kernel, an (N-1) x R tile held
                         across its token loop. "split": a second kernel, one order per
                         program; the rows kernel then needs fewer registers a thread (sm_90,
                         N 5, R 1024, 4 warps: 113 against 209; research/GPU.md). Equal up to fp32
                         summation order. "sorted": the fused kernel stores each token's row
                         gradients and torch's sort-based index_put_ sums them per row, in
                         place of its atomic adds (tngram.kernels.tngram_triton; deterministic
                         factor gradients). Default "fused" until a GPU measures another faster
                         (`python -m research bench gpu --sections kernels`).
    triton_backward_warps
                         num_warps of the Triton backward's kernels; 0 (default): the forward's
                         (4 up to R 1024, else 8). Same numbers at any value.
    fuse_kv              with one hyper-connection branch, K and V are one matmul against
                         [W_K; W_V] (tngram.memory.gating.GatedFusion.keys_values) ...
    fuse_kv_min_rows     ... from this many rows of e on (default 64; below it, as at decode time,
                         the weight concatenation costs more than the saved matmul).

Environment variables read elsewhere that change what runs: TNGRAM_CHECK_IDS
(tngram.memory.ngrams.check_ids_in_forward: whether the forward checks ids against the
vocabulary); both are listed in docs/TRAINING.md "Environment variables".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

FUSE_KV_MIN_ROWS = 64
LOOKUP_IMPLS = ("auto", "torch", "c", "triton")
TRITON_BACKWARDS = ("fused", "split", "sorted")


@dataclass(frozen=True)
class KernelPolicy:
    lookup_impl: str | None = None  # None: TNGRAM_LOOKUP_IMPL or "auto" (kernels.choice)
    bf16_lookup_output: bool = True
    triton_backward: str = "fused"
    triton_backward_warps: int = 0
    fuse_kv: bool = True
    fuse_kv_min_rows: int = FUSE_KV_MIN_ROWS


_current = KernelPolicy()


def current_policy() -> KernelPolicy:
    return _current


@contextmanager
def kernel_policy(**changes: Any) -> Iterator[KernelPolicy]:
    """Within the block, the policy with `changes` applied (e.g. kernel_policy(fuse_kv=False))."""
    global _current
    if changes.get("lookup_impl") not in (None, *LOOKUP_IMPLS):
        raise ValueError(
            f"lookup_impl must be one of {LOOKUP_IMPLS}, got {changes['lookup_impl']!r}"
        )
    if changes.get("triton_backward", "fused") not in TRITON_BACKWARDS:
        raise ValueError(
            f"triton_backward must be one of {TRITON_BACKWARDS}, got {changes['triton_backward']!r}"
        )
    if changes.get("triton_backward_warps", 0) not in (0, 1, 2, 4, 8, 16, 32):
        raise ValueError(
            "triton_backward_warps must be 0 (the default) or a power of two up to 32, "
            f"got {changes['triton_backward_warps']!r}"
        )
    old = _current
    _current = replace(old, **changes)
    try:
        yield _current
    finally:
        _current = old


def autocast_on(h: Tensor) -> bool:
    try:
        return bool(torch.is_autocast_enabled(h.device.type))
    except TypeError:  # older torch: no device argument
        return bool(torch.is_autocast_enabled())


def lookup_out_dtype(h: Tensor) -> torch.dtype | None:
    """The dtype a lookup feeding hidden states `h` may write e in: bf16 under CPU or CUDA bf16
    autocast (with bf16_lookup_output), else None (the factors' dtype). A kernel that cannot
    write it returns the factors' dtype and the caller casts (`lookup_output_for`)."""
    dev = h.device.type
    if (
        _current.bf16_lookup_output
        and dev in ("cpu", "cuda")
        and torch.is_autocast_enabled(dev)
        and torch.get_autocast_dtype(dev) == torch.bfloat16
    ):
        return torch.bfloat16
    return None


def lookup_output_for(e: Tensor, h: Tensor, out_dtype: torch.dtype | None) -> Tensor:
    """e as the K/V stage takes it: kept when the lookup already wrote `out_dtype`; cast to h's
    dtype when h has e's dtype or autocast is on; otherwise (bf16/fp16 h without autocast) left in
    the weights' dtype, as Engram's table rows are."""
    if (out_dtype is None or e.dtype != out_dtype) and (h.dtype == e.dtype or autocast_on(h)):
        return e.to(h.dtype)
    return e

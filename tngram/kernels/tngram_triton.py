"""Triton kernels of the fused TN-gram lookup (CUDA), same equations as `tngram_lookup.py`.

Imported lazily (only `tngram.kernels.fused_lookup(..., impl="triton")` or a CUDA tensor with
triton installed imports it), so the package imports cleanly without triton. On CPU the kernels
run under the Triton interpreter (TRITON_INTERPRET=1 set before this module is imported), which
is how tests/test_fused_lookup.py checks them on a machine without a GPU.

forward, one program per token m (BLOCK_R >= R lanes hold one row of R floats):
    p = A_N[x_t];  for k = 1..N-1:  p *= A_{N-k}[x_{t-k}];  b = p W_{k-1}
    r = rsqrt(mean(b^2) + eps)  (stored);  e_{k-1} = s_{k-1} r b

backward, one program per BLOCK_M tokens (a loop), per token a reverse sweep k = N..2 that
recomputes the prefix products P_{k-1}, P_k from the rows (O(N^2) row loads, all cache hits;
the kernels also compile for sm_80 without a GPU, checked with triton.compile):
    G += D_{k-2};  d rows_{k-1} = G P_{k-1};  G *= rows_{k-1};   finally d rows_0 = G
with D_j = W_j db_j and db_j the RMSNorm backward. Row gradients go to an fp32 table gradient by
atomic adds (rows repeat across tokens); dW and ds are summed over the program's tokens in
registers ((N-1) x BLOCK_R tile) and added atomically once per program.

Dimension letters: M tokens, N max order, V vocab, R CP rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _tngram_fwd_kernel(table_ptr, idx_ptr, w_ptr, s_ptr, out_ptr, rstd_ptr, R, eps,
                       N: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr,
                       USE_NORM: tl.constexpr, BLOCK_R: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    mask = cols < R
    row = tl.load(idx_ptr + m * N)
    p = tl.load(table_ptr + row * R + cols, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, N):
        row = tl.load(idx_ptr + m * N + k)
        p = p * tl.load(table_ptr + row * R + cols, mask=mask, other=0.0).to(tl.float32)
        b = p
        if HAS_W:
            b = b * tl.load(w_ptr + (k - 1) * R + cols, mask=mask, other=0.0).to(tl.float32)
        if USE_NORM:
            r = 1.0 / tl.sqrt(tl.sum(b * b, axis=0) / R + eps)
            tl.store(rstd_ptr + m * (N - 1) + (k - 1), r)
            b = b * r
        if HAS_S:
            b = b * tl.load(s_ptr + (k - 1)).to(tl.float32)
        tl.store(out_ptr + (m * (N - 1) + (k - 1)) * R + cols,
                 b.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tngram_bwd_kernel(table_ptr, idx_ptr, w_ptr, s_ptr, rstd_ptr, grad_ptr,
                       dtable_ptr, dw_ptr, ds_ptr, M, R,
                       N: tl.constexpr, HAS_W: tl.constexpr, HAS_S: tl.constexpr,
                       USE_NORM: tl.constexpr, NEED_TABLE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)                                  # order slots j = 0..N-2 (padded)
    dw_acc = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    ds_acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for i in range(0, BLOCK_M):
        m_raw = pid * BLOCK_M + i
        m = tl.minimum(m_raw, M - 1)                            # clamped: loads stay in bounds
        mask = (cols < R) & ((cols * 0 + m_raw) < M)            # dead tokens add nothing
        G = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for kr in tl.static_range(0, N - 1):
            k = N - kr                                          # k = N .. 2
            j = k - 2
            # prefix products P_{k-1} (rows 0..k-2) and P_k = P_{k-1} rows_{k-1}
            row0 = tl.load(idx_ptr + m * N)
            Pkm1 = tl.load(table_ptr + row0 * R + cols, mask=mask, other=0.0).to(tl.float32)
            for q in tl.static_range(1, N - 1):                # rows q < k-1 only (k is not a
                rq = tl.load(idx_ptr + m * N + q)               # compile-time constant here)
                use = mask & ((cols * 0 + q) < k - 1)
                Pkm1 = Pkm1 * tl.load(table_ptr + rq * R + cols, mask=use, other=1.0).to(tl.float32)
            rlast = tl.load(idx_ptr + m * N + (k - 1))
            xlast = tl.load(table_ptr + rlast * R + cols, mask=mask, other=0.0).to(tl.float32)
            Pk = Pkm1 * xlast
            g = tl.load(grad_ptr + (m * (N - 1) + j) * R + cols, mask=mask, other=0.0).to(tl.float32)
            b = Pk
            if HAS_W:
                wj = tl.load(w_ptr + j * R + cols, mask=cols < R, other=0.0).to(tl.float32)
                b = b * wj
            s = 1.0
            if HAS_S:
                s = tl.load(s_ptr + j).to(tl.float32)
            if USE_NORM:
                r = tl.load(rstd_ptr + m * (N - 1) + j)
                y = b * r
                gdot = tl.sum(g * y, axis=0)
                ds_acc += tl.where(kk == j, gdot, 0.0)
                db = (r * s) * g - (r * s * gdot / R) * y
            else:
                ds_acc += tl.where(kk == j, tl.sum(g * b, axis=0), 0.0)
                db = s * g
            if HAS_W:
                dw_acc += tl.where(kk[:, None] == j, (db * Pk)[None, :], 0.0)
                db = db * wj
            if NEED_TABLE:
                G = G + db                                      # grad w.r.t. P_k
                tl.atomic_add(dtable_ptr + rlast * R + cols, G * Pkm1, mask=mask)
                G = G * xlast                                   # grad w.r.t. P_{k-1}
        if NEED_TABLE:
            row0 = tl.load(idx_ptr + m * N)
            tl.atomic_add(dtable_ptr + row0 * R + cols, G, mask=mask)
    kmask = kk < N - 1
    if HAS_W:
        tl.atomic_add(dw_ptr + kk[:, None] * R + cols[None, :], dw_acc,
                      mask=kmask[:, None] & (cols[None, :] < R))
    if HAS_S:
        tl.atomic_add(ds_ptr + kk, ds_acc, mask=kmask)


def _launch_cfg(R: int) -> tuple[int, int]:
    block_r = triton.next_power_of_2(R)
    return block_r, (4 if block_r <= 1024 else 8)


class TritonTNGramLookup(torch.autograd.Function):
    """Same interface as `tngram_lookup.FusedTNGramLookup` (the chunk argument is ignored)."""

    @staticmethod
    def forward(ctx, factors: Tensor, idx: Tensor, W: Tensor | None, scales: Tensor | None,  # noqa: ANN001
                use_norm: bool, eps: float, chunk: int) -> Tensor:
        N, V, R = factors.shape
        M = idx.shape[0]
        table = factors.contiguous().view(N * V, R)
        idx = idx.contiguous()
        out = torch.empty(M, N - 1, R, dtype=factors.dtype, device=factors.device)
        rstd = torch.empty(M, N - 1, dtype=torch.float32, device=factors.device)
        Wc = W.contiguous() if W is not None else table
        sc = scales.contiguous() if scales is not None else table
        block_r, warps = _launch_cfg(R)
        if M > 0:
            _tngram_fwd_kernel[(M,)](table, idx, Wc, sc, out, rstd, R, eps, N=N,
                                     HAS_W=W is not None, HAS_S=scales is not None,
                                     USE_NORM=use_norm, BLOCK_R=block_r, num_warps=warps)
        ctx.save_for_backward(factors, idx, W, scales, rstd)
        ctx.use_norm = use_norm
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        factors, idx, W, scales, rstd = ctx.saved_tensors
        N, V, R = factors.shape
        M = idx.shape[0]
        dev = factors.device
        need_f = ctx.needs_input_grad[0]
        table = factors.contiguous().view(N * V, R)
        dtable = torch.zeros(N * V, R, dtype=torch.float32, device=dev)
        dW = torch.zeros(N - 1, R, dtype=torch.float32, device=dev)
        ds = torch.zeros(N - 1, dtype=torch.float32, device=dev)
        Wc = W.contiguous() if W is not None else table
        sc = scales.contiguous() if scales is not None else table
        block_r, warps = _launch_cfg(R)
        block_m = 16
        if M > 0:
            grid = (triton.cdiv(M, block_m),)
            _tngram_bwd_kernel[grid](table, idx, Wc, sc, rstd, grad.contiguous(), dtable, dW, ds,
                                     M, R, N=N, HAS_W=W is not None, HAS_S=scales is not None,
                                     USE_NORM=ctx.use_norm, NEED_TABLE=need_f, BLOCK_M=block_m,
                                     BLOCK_R=block_r, BLOCK_K=triton.next_power_of_2(N - 1),
                                     num_warps=warps)
        d_f = dtable.to(factors.dtype).view(N, V, R) if need_f else None
        d_W = dW.to(W.dtype) if (W is not None and ctx.needs_input_grad[2]) else None
        d_s = ds.to(scales.dtype) if (scales is not None and ctx.needs_input_grad[3]) else None
        return d_f, None, d_W, d_s, None, None, None

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

split backward (kernel_policy(triton_backward="split")): the same rows kernel without the tile
(ACC_WS=False), then `_tngram_bwd_ws_kernel` on a (token blocks, N-1) grid: one order slot per
program, one R-wide dW accumulator over SPLIT_WS_TOKENS tokens. It recomputes the prefix
products once more (O(N^2) more row loads, cache hits) to give the rows kernel about half its
registers: for sm_90 (triton 3.9, compiled without a GPU) at N 5, R 1024, 4 warps the rows
kernel needs 113 registers a thread instead of 209 (research/scripts/triton_registers.py). Which is
faster is a GPU measurement (`python -m research bench gpu --sections kernels`); same numbers up to
the
fp32 order of the dW / ds sums.

sorted backward (kernel_policy(triton_backward="sorted")): the fused rows kernel stores each
token's N row gradients (ROWS_OUT: an (M N, R) fp32 buffer, 4 M N R bytes, e.g. 1.3 GB at
64 x 1,024 tokens and R 1,024) instead of adding them to the table gradient by atomics, and
torch's sort-based index_put_(accumulate=True) sums them per row (tngram_lookup's
`sum_rows_sorted`). The atomics it replaces are N R per token, and the rows of frequent tokens
take many of them; the sorted sum writes and reads the buffer once more. Which is faster is a
GPU measurement (the kernels section, also `row_grads` there); the factor gradients are then
the same sums in another order (deterministic), dW and ds the fused kernel's.

Dimension letters: M tokens, N max order, V vocab, R CP rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from tngram.kernels.policy import current_policy
from tngram.kernels.tngram_lookup import sum_rows_sorted
from tngram.kernels.triton_round import round_to

SPLIT_WS_TOKENS = 64  # tokens per program of the split backward's dW / ds kernel


@triton.jit
def _tngram_fwd_kernel(
    table_ptr,
    idx_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    rstd_ptr,
    R,
    eps,
    N: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_S: tl.constexpr,
    USE_NORM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SUM_ORDERS: tl.constexpr = False,
):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    mask = cols < R
    row = tl.load(idx_ptr + m * N)
    p = tl.load(table_ptr + row * R + cols, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)  # SUM_ORDERS: e_1 + ... + e_{N-1}, in order
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
        if SUM_ORDERS:
            acc = acc + b
        else:
            b = round_to(b, out_ptr)  # e in the output's dtype (bf16: rounded as torch's cast)
            tl.store(
                out_ptr + (m * (N - 1) + (k - 1)) * R + cols,
                b.to(out_ptr.dtype.element_ty),
                mask=mask,
            )
    if SUM_ORDERS:  # one R-wide row per token, rounded once
        acc = round_to(acc, out_ptr)
        tl.store(out_ptr + m * R + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_grad(grad_ptr, m, j, R, cols, mask, N: tl.constexpr, SUM_ORDERS: tl.constexpr):
    """The gradient of token m's order-j output, fp32: its row of the (M, N-1, R) gradient, or
    with SUM_ORDERS the summed output's row (every order's e got it)."""
    if SUM_ORDERS:
        g = tl.load(grad_ptr + m * R + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(grad_ptr + (m * (N - 1) + j) * R + cols, mask=mask, other=0.0).to(tl.float32)
    return g


@triton.jit
def _order_grad(g, b, rstd_ptr, m, j, s, R, N: tl.constexpr, USE_NORM: tl.constexpr):
    """Backward of one order's output e_j = s rstd b (e_j = s b without the norm), per token:
    g the gradient of e_j, b the pre-norm row (BLOCK_R lanes) -> (db, gy, gy summed over R)
    with gy = g * de_j/ds per lane, whose sum is this token's part of ds_j."""
    if USE_NORM:
        r = tl.load(rstd_ptr + m * (N - 1) + j)
        y = b * r
        gy = g * y
        gdot = tl.sum(gy, axis=0)
        db = (r * s) * g - (r * s * gdot / R) * y
    else:
        gy = g * b
        gdot = tl.sum(gy, axis=0)
        db = s * g
    return db, gy, gdot


# one GPU program: a @triton.jit body compiles to a single kernel, so splitting it into jit
# helpers changes nothing measurable and reads worse (hence the statement-count exemption)
@triton.jit
def _tngram_bwd_kernel(  # noqa: PLR0915
    table_ptr,
    idx_ptr,
    w_ptr,
    s_ptr,
    rstd_ptr,
    grad_ptr,
    dtable_ptr,
    drows_ptr,
    dw_ptr,
    ds_ptr,
    M,
    R,
    N: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_S: tl.constexpr,
    USE_NORM: tl.constexpr,
    NEED_TABLE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUM_ORDERS: tl.constexpr = False,
    ACC_WS: tl.constexpr = True,
    ROWS_OUT: tl.constexpr = False,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)  # order slots j = 0..N-2 (padded)
    dw_acc = tl.zeros((BLOCK_K, BLOCK_R), dtype=tl.float32)
    ds_acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for i in range(0, BLOCK_M):
        m_raw = pid * BLOCK_M + i
        m = tl.minimum(m_raw, M - 1)  # clamped: loads stay in bounds
        mask = (cols < R) & ((cols * 0 + m_raw) < M)  # dead tokens add nothing
        G = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for kr in tl.static_range(0, N - 1):
            k = N - kr  # k = N .. 2
            j = k - 2
            # prefix products P_{k-1} (rows 0..k-2) and P_k = P_{k-1} rows_{k-1}
            row0 = tl.load(idx_ptr + m * N)
            Pkm1 = tl.load(table_ptr + row0 * R + cols, mask=mask, other=0.0).to(tl.float32)
            for q in tl.static_range(1, N - 1):  # rows q < k-1 only (k is not a
                rq = tl.load(idx_ptr + m * N + q)  # compile-time constant here)
                use = mask & ((cols * 0 + q) < k - 1)
                Pkm1 = Pkm1 * tl.load(table_ptr + rq * R + cols, mask=use, other=1.0).to(tl.float32)
            rlast = tl.load(idx_ptr + m * N + (k - 1))
            xlast = tl.load(table_ptr + rlast * R + cols, mask=mask, other=0.0).to(tl.float32)
            Pk = Pkm1 * xlast
            g = _load_grad(grad_ptr, m, j, R, cols, mask, N, SUM_ORDERS)
            b = Pk
            if HAS_W:
                wj = tl.load(w_ptr + j * R + cols, mask=cols < R, other=0.0).to(tl.float32)
                b = b * wj
            s = 1.0
            if HAS_S:
                s = tl.load(s_ptr + j).to(tl.float32)
            db, gy, gdot = _order_grad(g, b, rstd_ptr, m, j, s, R, N, USE_NORM)
            if ACC_WS:
                ds_acc += tl.where(kk == j, gdot, 0.0)
            if HAS_W:
                if ACC_WS:
                    dw_acc += tl.where(kk[:, None] == j, (db * Pk)[None, :], 0.0)
                db = db * wj
            if NEED_TABLE:
                G = G + db  # grad w.r.t. P_k
                if ROWS_OUT:  # token m's row gradient of column k-1, summed later (sorted)
                    tl.store(drows_ptr + (m * N + (k - 1)) * R + cols, G * Pkm1, mask=mask)
                else:
                    tl.atomic_add(dtable_ptr + rlast * R + cols, G * Pkm1, mask=mask)
                G = G * xlast  # grad w.r.t. P_{k-1}
        if NEED_TABLE:
            if ROWS_OUT:
                tl.store(drows_ptr + m * N * R + cols, G, mask=mask)
            else:
                row0 = tl.load(idx_ptr + m * N)
                tl.atomic_add(dtable_ptr + row0 * R + cols, G, mask=mask)
    kmask = kk < N - 1
    if HAS_W and ACC_WS:
        tl.atomic_add(
            dw_ptr + kk[:, None] * R + cols[None, :],
            dw_acc,
            mask=kmask[:, None] & (cols[None, :] < R),
        )
    if HAS_S and ACC_WS:
        tl.atomic_add(ds_ptr + kk, ds_acc, mask=kmask)


@triton.jit
def _tngram_bwd_ws_kernel(
    table_ptr,
    idx_ptr,
    w_ptr,
    s_ptr,
    rstd_ptr,
    grad_ptr,
    dw_ptr,
    ds_ptr,
    M,
    R,
    N: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_S: tl.constexpr,
    USE_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SUM_ORDERS: tl.constexpr = False,
):
    """The split backward's second kernel: dW_j and ds_j of ONE order slot j = program_id(1)
    over BLOCK_M tokens, in one R-wide accumulator (no (N-1) x R tile held across the token
    loop). Per token: P = rows 0..j+1 multiplied, b = P w_j, then the same db as the rows kernel."""
    pid = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # order slot: e_{j+1} reads rows 0..j+1
    cols = tl.arange(0, BLOCK_R)
    dw_acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    ds_acc = tl.zeros((BLOCK_R,), dtype=tl.float32)  # summed over R once, at the end
    s = 1.0
    if HAS_S:
        s = tl.load(s_ptr + j).to(tl.float32)
    wj = tl.full((BLOCK_R,), 1.0, dtype=tl.float32)
    if HAS_W:
        wj = tl.load(w_ptr + j * R + cols, mask=cols < R, other=0.0).to(tl.float32)
    for i in range(0, BLOCK_M):
        m_raw = pid * BLOCK_M + i
        m = tl.minimum(m_raw, M - 1)  # clamped: loads stay in bounds
        mask = (cols < R) & ((cols * 0 + m_raw) < M)  # dead tokens add nothing
        row0 = tl.load(idx_ptr + m * N)
        P = tl.load(table_ptr + row0 * R + cols, mask=mask, other=0.0).to(tl.float32)
        for q in tl.static_range(1, N):  # rows q <= j+1 (j is not a compile-time constant)
            rq = tl.load(idx_ptr + m * N + q)
            use = mask & ((cols * 0 + q) <= j + 1)
            P = P * tl.load(table_ptr + rq * R + cols, mask=use, other=1.0).to(tl.float32)
        g = _load_grad(grad_ptr, m, j, R, cols, mask, N, SUM_ORDERS)
        db, gy, _ = _order_grad(g, P * wj, rstd_ptr, m, j, s, R, N, USE_NORM)
        ds_acc += gy
        if HAS_W:
            dw_acc += db * P
    if HAS_W:
        tl.atomic_add(dw_ptr + j * R + cols, dw_acc, mask=cols < R)
    if HAS_S:
        tl.atomic_add(ds_ptr + j, tl.sum(ds_acc, axis=0))


def _launch_cfg(R: int) -> tuple[int, int]:
    block_r = triton.next_power_of_2(R)
    return block_r, (4 if block_r <= 1024 else 8)


def default_warps(R: int) -> int:
    """num_warps of the forward (and of the backward unless triton_backward_warps says)."""
    return _launch_cfg(R)[1]


# The launches are wrapped as torch.library custom ops (forward, backward) with fake
# implementations, so torch.compile(fullgraph=True) sees two opaque ops with known output shapes
# instead of tracing triton launches. Optional inputs: `Optional[Tensor]` (schema inference).


@torch.library.custom_op("tngram::triton_lookup_fwd", mutates_args=())
def triton_lookup_fwd(
    factors: Tensor,
    idx: Tensor,
    W: Optional[Tensor],
    scales: Optional[Tensor],
    use_norm: bool,
    eps: float,
    out_bf16: bool = False,
    sum_orders: bool = False,
    split_bwd: bool = False,
    bwd_warps: int = 0,
    sorted_bwd: bool = False,
) -> tuple[Tensor, Tensor]:
    """factors (N, V, R), idx (M, N) row ids -> e (M, N-1, R) in factors' dtype (bf16 with
    out_bf16: the fp32 e rounded, bit-identical to casting it), rstd (M, N-1) fp32.
    sum_orders: e summed over the orders, (M, R), in the epilogue (fp32, in order 1..N-1, then
    rounded once): no (N-1) R-wide e is written. split_bwd, bwd_warps, sorted_bwd: how its
    autograd runs the backward (`triton_lookup_bwd`'s split, warps and sorted; the forward
    ignores them)."""
    N, V, R = factors.shape
    M = idx.shape[0]
    table = factors.contiguous().view(N * V, R)
    idx = idx.contiguous()
    e_dtype = torch.bfloat16 if out_bf16 else factors.dtype
    out = torch.empty(M, *(() if sum_orders else (N - 1,)), R, dtype=e_dtype, device=factors.device)
    rstd = torch.empty(M, N - 1, dtype=torch.float32, device=factors.device)
    Wc = W.contiguous() if W is not None else table
    sc = scales.contiguous() if scales is not None else table
    block_r, warps = _launch_cfg(R)
    if M > 0:
        _tngram_fwd_kernel[(M,)](
            table,
            idx,
            Wc,
            sc,
            out,
            rstd,
            R,
            eps,
            N=N,
            HAS_W=W is not None,
            HAS_S=scales is not None,
            USE_NORM=use_norm,
            BLOCK_R=block_r,
            SUM_ORDERS=sum_orders,
            num_warps=warps,
        )
    return out, rstd


@triton_lookup_fwd.register_fake
def _(
    factors,
    idx,
    W,
    scales,
    use_norm,
    eps,
    out_bf16=False,
    sum_orders=False,
    split_bwd=False,
    bwd_warps=0,
    sorted_bwd=False,
):  # noqa: ANN001, ANN202
    N, V, R = factors.shape
    M = idx.shape[0]
    e_dtype = torch.bfloat16 if out_bf16 else factors.dtype
    return (
        factors.new_empty(M, *(() if sum_orders else (N - 1,)), R, dtype=e_dtype),
        factors.new_empty(M, N - 1, dtype=torch.float32),
    )


@torch.library.custom_op("tngram::triton_lookup_bwd", mutates_args=())
def triton_lookup_bwd(
    grad: Tensor,
    factors: Tensor,
    idx: Tensor,
    W: Optional[Tensor],
    scales: Optional[Tensor],
    rstd: Tensor,
    use_norm: bool,
    need_factors: bool,
    sum_orders: bool = False,
    split: bool = False,
    warps: int = 0,
    sorted_rows: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> d factors (N, V, R) (empty unless need_factors), dW (N-1, R), ds (N-1,) fp32.
    split: the rows kernel leaves dW and ds to `_tngram_bwd_ws_kernel` (module docstring).
    warps: num_warps of both kernels (0: `_launch_cfg`'s, the forward's). sorted_rows: the rows
    kernel stores each token's row gradients (M N, R) instead of adding them, and torch's
    sort-based index_put_(accumulate=True) sums them into d factors (module docstring)."""
    N, V, R = factors.shape
    M = idx.shape[0]
    dev = factors.device
    table = factors.contiguous().view(N * V, R)
    dtable = torch.zeros(N * V if need_factors else 0, R, dtype=torch.float32, device=dev)
    rows_out = sorted_rows and need_factors and M > 0
    drows = torch.empty(M * N if rows_out else 0, R, dtype=torch.float32, device=dev)
    dW = torch.zeros(N - 1, R, dtype=torch.float32, device=dev)
    ds = torch.zeros(N - 1, dtype=torch.float32, device=dev)
    Wc = W.contiguous() if W is not None else table
    sc = scales.contiguous() if scales is not None else table
    block_r, fwd_warps = _launch_cfg(R)
    warps = warps or fwd_warps
    block_m = 16
    flags = dict(N=N, HAS_W=W is not None, HAS_S=scales is not None, USE_NORM=use_norm)
    if M > 0 and (need_factors or not split):
        grid = (triton.cdiv(M, block_m),)
        _tngram_bwd_kernel[grid](
            table,
            idx.contiguous(),
            Wc,
            sc,
            rstd,
            grad.contiguous(),
            dtable if need_factors else table,
            drows if rows_out else table,
            dW,
            ds,
            M,
            R,
            **flags,
            NEED_TABLE=need_factors,
            BLOCK_M=block_m,
            BLOCK_R=block_r,
            BLOCK_K=triton.next_power_of_2(N - 1),
            SUM_ORDERS=sum_orders,
            ACC_WS=not split,
            ROWS_OUT=rows_out,
            num_warps=warps,
        )
    if rows_out:
        sum_rows_sorted(dtable, idx.reshape(-1), drows)
    if M > 0 and split and (W is not None or scales is not None):
        _tngram_bwd_ws_kernel[(triton.cdiv(M, SPLIT_WS_TOKENS), N - 1)](
            table,
            idx.contiguous(),
            Wc,
            sc,
            rstd,
            grad.contiguous(),
            dW,
            ds,
            M,
            R,
            **flags,
            BLOCK_M=SPLIT_WS_TOKENS,
            BLOCK_R=block_r,
            SUM_ORDERS=sum_orders,
            num_warps=warps,
        )
    d_f = dtable.to(factors.dtype).view(N, V, R) if need_factors else factors.new_empty(0)
    return d_f, dW, ds


@triton_lookup_bwd.register_fake
def _(
    grad,
    factors,
    idx,
    W,
    scales,
    rstd,
    use_norm,
    need_factors,
    sum_orders=False,
    split=False,
    warps=0,
    sorted_rows=False,
):  # noqa: ANN001, ANN202
    N, V, R = factors.shape
    return (
        factors.new_empty(N, V, R) if need_factors else factors.new_empty(0),
        factors.new_empty(N - 1, R, dtype=torch.float32),
        factors.new_empty(N - 1, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    factors, idx, W, scales, use_norm, eps, _, sum_orders, split_bwd, bwd_warps, sorted_bwd = inputs
    ctx.save_for_backward(factors, idx, W, scales, output[1])
    ctx.use_norm, ctx.sum_orders = use_norm, sum_orders
    ctx.split_bwd, ctx.bwd_warps, ctx.sorted_bwd = split_bwd, bwd_warps, sorted_bwd


def _backward(ctx, grad_out, grad_rstd):  # noqa: ANN001, ANN202
    factors, idx, W, scales, rstd = ctx.saved_tensors
    need_f, _, need_W, need_s = ctx.needs_input_grad[:4]
    d_f, dW, ds = triton_lookup_bwd(
        grad_out,
        factors,
        idx,
        W,
        scales,
        rstd,
        ctx.use_norm,
        need_f,
        ctx.sum_orders,
        ctx.split_bwd,
        ctx.bwd_warps,
        ctx.sorted_bwd,
    )
    return (
        d_f if need_f else None,
        None,
        dW.to(W.dtype) if (W is not None and need_W) else None,
        ds.to(scales.dtype) if (scales is not None and need_s) else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


triton_lookup_fwd.register_autograd(_backward, setup_context=_setup_context)


def triton_lookup(
    factors: Tensor,
    idx: Tensor,
    W: Tensor | None,
    scales: Tensor | None,
    use_norm: bool,
    eps: float,
    chunk: int = 0,
    out_dtype: torch.dtype | None = None,
    sum_orders: bool = False,
) -> Tensor:
    """Same contract as `FusedTNGramLookup.apply` (chunk is ignored); sum_orders: e summed over
    the orders in the kernel, (M, R) (`triton_lookup_fwd`). out_dtype torch.bfloat16
    (fused_lookup's, under bf16 autocast) writes e in bf16 directly: no fp32 e, no cast pass;
    the same bits as the cast, and the backward takes the bf16 upstream gradient as the cast's
    backward would hand it on (upcast in the kernel, exact)."""
    if out_dtype not in (None, factors.dtype, torch.bfloat16):
        raise ValueError(f"triton_lookup out_dtype must be None or bfloat16, got {out_dtype}")
    out_bf16 = out_dtype == torch.bfloat16
    pol = current_policy()  # the backward's variant and warps (tngram.kernels.policy)
    split, warps = pol.triton_backward == "split", pol.triton_backward_warps
    sorted_bwd = pol.triton_backward == "sorted"
    return triton_lookup_fwd(
        factors, idx, W, scales, use_norm, eps, out_bf16, sum_orders, split, warps, sorted_bwd
    )[0]


# dtypes it writes directly (fused_lookup's out_dtype); it can sum the orders (sum_orders)
triton_lookup.out_dtypes = (torch.bfloat16,)  # type: ignore[attr-defined]
triton_lookup.sums_orders = True  # type: ignore[attr-defined]

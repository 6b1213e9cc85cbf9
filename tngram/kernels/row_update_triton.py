"""Triton kernel of the row-sparse table updates (LazyAdam / RowwiseAdam, with catch-up).

One program per tile of touched rows (BLOCK_U rows x BLOCK_W lanes): it loads the rows' weights,
moments (and, with catch-up, their per-row factors), updates them in registers and stores them
back in place. Nothing outside the touched
rows is read or written: no gathered copies, no dense zero-fill, no pass over the table. Rows
must be distinct (a coalesced sparse gradient's rows are), so no two programs write one row.

The arithmetic is the torch path's (`tngram.optim.row_adams`), operation by operation, with the
same roundings: every intermediate the torch path stores in the table's dtype is rounded to it
here (a no-op for fp32 tables), computed in fp32 in between (torch's opmath for fp32/bf16), with
IEEE-rounded division and square root (`div_rn`, `sqrt_rn`, as torch's kernels; Triton's `/`
and `tl.sqrt` are approximate on the GPU). Per touched row i of width W at the table's step t:

    catch-up (CATCHUP, factors from the torch side):  missed = m * f_i  (rowwise)
        | where(v > 0, m / sqrt(v), 0) * f_i  (lazy);  w += missed;  m *= d1_i;  v *= d2_i
    step (STEP), lazy:     m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g g
                           w += c * m / (sqrt(v) + eps)              c = -lr sqrt(1-b2^t)/(1-b1^t)
    step, rowwise:         m as above;  v_row = b2 v_row + (1-b2) sum(g^2)/W   (fp32)
                           w += c * m / (sqrt(v_row) / sqrt(1-b2^t) + eps)   c = -lr/(1-b1^t)
The adds torch does with one rounding (add_ with alpha, addcmul_) are FMAs here; its division
by the host scalar sqrt(1-b2^t) is a product with the fp32 reciprocal on CUDA (as ATen's) and a
division on CPU; add_'s alpha is rounded to a bf16/fp16 table's dtype on CPU (not on CUDA).
What is left to differ is the order of rowwise's sum over W and, on CPU, a double rounding.
    last step (MARK):      1: last_i = t;  2: last_i = t where last_i > 0 (settling on read)

Imported lazily (tngram.kernels.row_update), so the package imports without triton; on CPU it
runs under the Triton interpreter (TRITON_INTERPRET=1), how tests/test_sparse_triton.py checks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tngram.kernels.triton_round import round_to as _rnd


# one GPU program: a @triton.jit body compiles to a single kernel, so splitting it into jit
# helpers changes nothing measurable and reads worse (hence the statement-count exemption)
@triton.jit
def _row_adam_kernel(  # noqa: PLR0915
    w_ptr,
    m_ptr,
    v_ptr,
    rows_ptr,
    g_ptr,
    last_ptr,
    f_ptr,
    d1_ptr,
    d2_ptr,
    U,
    W,
    t_mark,
    b1,
    a1,
    b2,
    a2,
    c_step,
    bc2,
    inv_w,
    w_f,
    eps,
    ROWWISE: tl.constexpr,
    STEP: tl.constexpr,
    CATCHUP: tl.constexpr,
    MARK: tl.constexpr,
    RECIP: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # a tile of BLOCK_U touched rows x BLOCK_W lanes; i: the rows' places in `rows`
    i = tl.program_id(0).to(tl.int64) * BLOCK_U + tl.arange(0, BLOCK_U)
    live = i < U
    r = tl.load(rows_ptr + i, mask=live, other=0).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    mask = live[:, None] & (cols < W)[None, :]
    off = r[:, None] * W + cols[None, :]
    # values are kept in fp32 registers, each already rounded to its tensor's dtype, so the
    # stores below only drop zero bits
    w = tl.load(w_ptr + off, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if ROWWISE:
        v = tl.load(v_ptr + r, mask=live, other=0.0).to(tl.float32)  # (BLOCK_U,)
    else:
        v = tl.load(v_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if CATCHUP:
        f = tl.load(f_ptr + i, mask=live, other=0.0).to(tl.float32)[:, None]
        if ROWWISE:
            missed = _rnd(m * f, w_ptr)
        else:
            sv = _rnd(tl.sqrt_rn(v), w_ptr)
            ratio = _rnd(tl.div_rn(m, tl.where(v > 0, sv, 1.0)), w_ptr)
            missed = _rnd(tl.where(v > 0, ratio, 0.0) * f, w_ptr)
        w = _rnd(w + missed, w_ptr)
        m = _rnd(m * tl.load(d1_ptr + i, mask=live, other=1.0).to(tl.float32)[:, None], w_ptr)
        d2 = tl.load(d2_ptr + i, mask=live, other=1.0).to(tl.float32)
        if ROWWISE:
            v = _rnd(v * d2, v_ptr)
        else:
            v = _rnd(v * d2[:, None], v_ptr)
    if STEP:
        g = tl.load(g_ptr + i[:, None] * W + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        m = _rnd(m * b1, w_ptr)
        m = _rnd(tl.fma(g, a1, m), w_ptr)  # torch's add_(g, alpha=a1): one rounding
        if ROWWISE:
            if RECIP:  # torch's mean: the sum times fp32 1/W on CUDA, divided by W on CPU
                ms = tl.sum(g * g, axis=1) * inv_w
            else:
                ms = tl.div_rn(tl.sum(g * g, axis=1), w_f)
            v = tl.fma(ms, a2, v * b2)
            sv = tl.sqrt_rn(v)
            if RECIP:  # torch on CUDA divides by a host scalar as a product with its reciprocal
                sv = sv * bc2
            else:
                sv = tl.div_rn(sv, bc2)
            den = _rnd(sv + eps, w_ptr)[:, None]
        else:
            v = _rnd(v * b2, v_ptr)
            v = _rnd(tl.fma(g * a2, g, v), v_ptr)  # addcmul_: v + (a2 g) g, one rounding
            den = _rnd(tl.sqrt_rn(v), w_ptr)
            den = _rnd(den + eps, w_ptr)
        q = _rnd(tl.div_rn(m, den), w_ptr)
        w = _rnd(w + _rnd(q * c_step, w_ptr), w_ptr)
    tl.store(w_ptr + off, w.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + off, m.to(m_ptr.dtype.element_ty), mask=mask)
    if ROWWISE:
        tl.store(v_ptr + r, v, mask=live)
    else:
        tl.store(v_ptr + off, v.to(v_ptr.dtype.element_ty), mask=mask)
    if MARK == 1:
        tl.store(last_ptr + r, tl.full([BLOCK_U], t_mark, tl.int32), mask=live)
    if MARK == 2:
        old = tl.load(last_ptr + r, mask=live, other=0)
        tl.store(last_ptr + r, tl.where(old > 0, t_mark, old), mask=live)


def triton_row_update(
    w: Tensor,
    m: Tensor,
    v: Tensor,
    rows: Tensor,
    grad: Tensor | None,
    *,
    rowwise: bool,
    t_mark: int,
    b1: float,
    b2: float,
    c_step: float,
    bc2: float,
    eps: float,
    last: Tensor | None = None,
    mark: int = 0,
    catchup: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Update rows `rows` (U,) of w (rows, W), m (rows, W), v ((rows, W), or (rows,) fp32 when
    rowwise) in place; grad (U, W) the rows' gradients (None: no step, catch-up only); catchup
    (f, d1, d2), each (U,): the missed-move factor and the moments' decay factors; last (rows,)
    int32 with mark 1 / 2 (module docstring). All tensors contiguous, on one device."""
    U, W = rows.numel(), w.shape[-1]
    if U == 0:
        return
    dummy = rows  # never read when its flag is off
    f, d1, d2 = catchup if catchup is not None else (dummy, dummy, dummy)
    BLOCK_W = triton.next_power_of_2(max(W, 1))
    BLOCK_U = max(1, min(64, 2048 // BLOCK_W))  # ~2k lanes a tile: 8 KiB of fp32 per tensor
    _row_adam_kernel[(triton.cdiv(U, BLOCK_U),)](
        w,
        m,
        v,
        rows,
        grad if grad is not None else dummy,
        last if last is not None else dummy,
        f,
        d1,
        d2,
        U,
        W,
        t_mark,
        b1,
        1.0 - b1 if w.is_cuda else _as(1.0 - b1, w.dtype),
        b2,
        1.0 - b2,
        c_step,
        _f32_recip(bc2) if w.is_cuda else bc2,
        _f32_recip(W),
        float(W),
        eps,
        ROWWISE=rowwise,
        STEP=grad is not None,
        CATCHUP=catchup is not None,
        MARK=mark,
        RECIP=w.is_cuda,
        BLOCK_U=BLOCK_U,
        BLOCK_W=BLOCK_W,
        num_warps=4,
    )


def _as(x: float, dtype: torch.dtype) -> float:
    """x rounded to `dtype`: torch on CPU rounds add_'s alpha to a bf16/fp16 tensor's dtype."""
    return float(torch.tensor(x, dtype=torch.float64).to(dtype))


def _f32_recip(x: float) -> float:
    """1 / x in fp32 arithmetic (x rounded to fp32 first), as ATen's CUDA kernels compute it."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(x, dtype=torch.float32))


__all__ = ["triton_row_update"]

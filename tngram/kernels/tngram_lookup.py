"""Fused TN-gram lookup (paper Eqs. 10-11) for CPU: torch ops and a hand-written backward.

The reference (`tngram.memory.cp`) builds e = concat_n exp(l_n) RMSNorm(b_n) with plain autograd,
which keeps every intermediate of the whole batch alive: the gathered rows (M, N, R), the cumprod
(M, N, R), b (M, N-1, R), the RMSNorm input/outputs and the scaled copy, and replays a generic
backward for each. Here one `torch.autograd.Function` does the whole lookup:

forward, for a chunk of `chunk` tokens at a time (so every temporary stays in cache):
    rows_k  = A_{N-k}[x_{t-k}]                    k = 0..N-1, one index_select (newest first)
    P_1 = rows_0,  P_k = P_{k-1} * rows_{k-1}     running Hadamard products, written in place
    b_j = P_{j+2} * W_j                           j = n-2, W_j = w_1 * ... * w_{N-2-j} (Eq. 10)
    r_j = rsqrt(mean_R(b_j^2) + eps)              saved, (M, N-1) - the only saved activation
    e_j = s_j * r_j * b_j                         s_j = exp(l_j) (Eq. 11)

backward, chunk by chunk, recomputing rows and P from the factors (a gather is cheaper than
keeping 2 * M * N * R floats alive until the backward); y = e / s is read from the saved output
(the returned tensor itself, so no extra memory):
    gy = s g
    ds_j  = sum_{t,R} g y
    db    = r (gy - y * mean_R(gy y))             RMSNorm backward (db = s g without the norm)
    dW_j  = sum_t db_j P_{j+2}
    D_j   = db_j W_j                              gradient w.r.t. P_{j+2}
    G_N = D_{N-2};  d rows_{k-1} = G_k P_{k-1};  G_{k-1} = G_k rows_{k-1} + D_{k-3}   (k = N..2)
    dA    = index_add of d rows at the gathered row ids (pads included, as in the reference)

W (N-1, R) and s (N-1,) are built from `absorb` / `log_scales` outside the Function with ordinary
autograd (tiny tensors), so their own backward (cumprod, exp) stays torch's.

The chunk loop runs with one intra-op thread (`_single_threaded`): its ops are small, and on a
shared 2-core machine OpenMP regions stall.

Low-precision factors (bf16/fp16) are computed in fp32 chunk buffers; the output and the factor
gradient are cast back to the factors' dtype.

Dimension letters: B batch, T time, M = B*T tokens, N max order, V vocab, R CP rank,
c tokens per chunk.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

DEFAULT_CHUNK_TOKENS = (
    64  # c: 64 tokens x N x R fp32 = 1.3 MiB at R = 1024 (best of 16..1024, 1 thread)
)


def ngram_row_index(ngrams: Tensor, vocab_size: int) -> Tensor:
    """Row ids into factors.view(N*V, R): (B, T, N) with column k = x_{t-k} -> (B*T, N) int64.

    Column k (token x_{t-k}) reads factor A_{N-k}, i.e. factors[N-1-k], row offset (N-1-k) * V.
    """
    N = ngrams.shape[-1]
    if torch.compiler.is_compiling():  # the cache dict is Python state dynamo cannot keep
        return (
            ngrams.long()
            + torch.arange(N - 1, -1, -1, device=ngrams.device, dtype=torch.int64) * vocab_size
        ).reshape(-1, N)
    key = (N, vocab_size, ngrams.device)
    offsets = _OFFSETS.get(key)
    if offsets is None:  # cached: a fresh arange cost ~0.4 ms per call here
        offsets = _OFFSETS[key] = (
            torch.arange(N - 1, -1, -1, device=ngrams.device, dtype=torch.int64) * vocab_size
        )
    return (ngrams.long() + offsets).reshape(-1, N)  # (M, N)


_OFFSETS: dict[tuple[int, int, torch.device], Tensor] = {}


def sum_rows_sorted(dtable: Tensor, rows: Tensor, drows: Tensor) -> None:
    """dtable[rows[i]] += drows[i] for every i (dtable (rows, R), rows (K,) int64, drows (K, R)),
    by torch's sort-based index_put_(accumulate=True): the row ids sorted, then one sum per
    distinct row, with no atomic adds of many threads to one address. Deterministic mode is on
    for the call (it makes torch take the sorted path on every device) and restored after. The
    Triton lookup's sorted backward sums its rows here (tngram.kernels.tngram_triton)."""
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        dtable.index_put_((rows,), drows, accumulate=True)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def absorption_weights(absorb: Tensor | None, N: int, R: int, like: Tensor) -> Tensor | None:
    """W_j = w_1 * ... * w_{N-2-j} for j = 0..N-2 as (N-1, R); None without absorption.

    Row j is order n = j + 2; the highest order (j = N-2) has the empty product 1.
    """
    if absorb is None or N <= 2:
        return None
    cum = [absorb[0]]  # W_1..W_{N-2}, each (R,)
    for i in range(1, N - 2):  # explicit products: torch.cumprod on (N-2, R) took ~0.4 ms here
        cum.append(cum[-1] * absorb[i])
    return torch.stack([*cum[::-1], like.new_ones(R)], dim=0)  # (N-1, R)


_WS = threading.local()


def _workspace(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """A reusable scratch tensor (uninitialised) of `shape`, kept per thread between calls.

    Large fresh allocations are slow here: glibc hands multi-MB blocks back to the kernel on
    free and every page faults again on the next step (research/PERFORMANCE.md). Scratch buffers
    never escape this module: outputs, saved tensors and gradients are always fresh tensors.
    """
    cache = getattr(_WS, "bufs", None)
    if cache is None:
        cache = _WS.bufs = {}
    n = math.prod(shape)
    key = (name, dtype, device)
    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        buf = cache[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


def clear_workspaces() -> None:
    """Free the scratch buffers of the calling thread."""
    _WS.bufs = {}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _prefix_products(rows: Tensor, out: Tensor) -> None:
    """rows (c, N, R) -> out (c, N-1, R) with out[:, j] = P_{j+2} = rows_0 * ... * rows_{j+1}."""
    r, o = rows.unbind(1), out.unbind(1)  # views, one call each
    torch.mul(r[0], r[1], out=o[0])
    for k in range(2, len(r)):
        torch.mul(o[k - 2], r[k], out=o[k - 1])


def _gather(table: Tensor, idx: Tensor, cdt: torch.dtype) -> Tensor:
    """table (N*V, R), idx (c, N) -> rows (c, N, R) in the compute dtype (a workspace view)."""
    c, N = idx.shape
    R = table.shape[1]
    raw = _workspace("rows_raw", (c * N, R), table.dtype, table.device)
    torch.index_select(table, 0, idx.reshape(-1), out=raw)
    if table.dtype == cdt:
        return raw.view(c, N, R)
    rows = _workspace("rows", (c, N, R), cdt, table.device)
    return rows.copy_(raw.view(c, N, R))


def _rowdot(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """sum_R a * b: (c, K, R) x2 -> out (c, K), through a workspace (no fresh allocation)."""
    tmp = _workspace("dot_tmp", tuple(a.shape), a.dtype, a.device)
    torch.mul(a, b, out=tmp)
    return torch.sum(tmp, dim=-1, out=out)


def lookup_forward(
    table: Tensor,
    idx: Tensor,
    W: Tensor | None,
    scales: Tensor | None,
    use_norm: bool,
    eps: float,
    chunk: int,
) -> tuple[Tensor, Tensor | None]:
    """e (M, N-1, R) in table's dtype and r (M, N-1) (None without the norm).

    table: factors viewed (N*V, R); idx: (M, N) from `ngram_row_index`; W: (N-1, R) or None;
    scales: (N-1,) or None. No autograd here.
    """
    M, N = idx.shape
    R = table.shape[1]
    cdt, dev = _compute_dtype(table.dtype), table.device
    out = torch.empty(M, N - 1, R, dtype=table.dtype, device=dev)
    rstd = torch.empty(M, N - 1, dtype=cdt, device=dev) if use_norm else None
    direct = out.dtype == cdt
    Wc = None if W is None else W.to(cdt)
    sc = None if scales is None else scales.to(cdt)
    for a in range(0, M, chunk):
        b_ = min(M, a + chunk)
        c = b_ - a
        rows = _gather(table, idx[a:b_], cdt)  # (c, N, R)
        o = out[a:b_] if direct else _workspace("o", (c, N - 1, R), cdt, dev)
        _prefix_products(rows, o)  # P_2..P_N
        if Wc is not None:
            o.mul_(Wc)  # b (Eq. 10)
        if rstd is not None:  # use_norm
            ms = _rowdot(o, o, _workspace("ms", (c, N - 1), cdt, dev))  # (c, N-1) sum b^2
            r = rstd[a:b_]
            torch.rsqrt(ms.div_(R).add_(eps), out=r)
            o.mul_((r * sc if sc is not None else r).unsqueeze(-1))  # s r b (Eq. 11)
        elif sc is not None:
            o.mul_(sc.unsqueeze(-1))
        if not direct:
            out[a:b_].copy_(o)
    return out, rstd


def _grad_b(
    g: Tensor,
    P: Tensor,
    Wc: Tensor | None,
    sc: Tensor | None,
    inv_s: Tensor | None,
    rstd: Tensor | None,
    out: Tensor | None,
    a: int,
    b_: int,
    use_out: bool,
    ds: Tensor | None,
) -> Tensor:
    """The gradient w.r.t. b (c, N-1, R) of one chunk (rows a:b_) from g = dL/de (c, N-1, R)
    through e = s RMSNorm(b) (Eq. 11; without the norm, e = s b); adds dL/ds into `ds`.
    P (c, N-1, R) holds the prefix products, b = W P (or P without absorption)."""
    c, N1, R = g.shape
    cdt, dev = g.dtype, g.device
    db = _workspace("db", (c, N1, R), cdt, dev)  # grad w.r.t. b
    if rstd is not None and use_out:
        assert out is not None  # what use_out means
        r = rstd[a:b_]  # (c, N-1)
        e = out[a:b_]  # e = s y
        gy = _rowdot(g, e, _workspace("gdot", (c, N1), cdt, dev))
        if inv_s is not None:
            gy.mul_(inv_s)  # sum_R g y
        if ds is not None:
            ds += gy.sum(0)
        # db = (r s) g - (r s gdot / R) y = (r s) g - (r gdot / R) e
        torch.mul(g, (r * sc if sc is not None else r).unsqueeze(-1), out=db)
        db.addcmul_(e, (r * gy).div_(R).unsqueeze(-1), value=-1.0)
    elif rstd is not None:  # use_norm
        r = rstd[a:b_]  # (c, N-1)
        y = _workspace("y", (c, N1, R), cdt, dev)  # y = RMSNorm(b)
        if Wc is not None:
            torch.mul(P, Wc, out=y)
            y.mul_(r.unsqueeze(-1))
        else:
            torch.mul(P, r.unsqueeze(-1), out=y)
        gdot = _rowdot(g, y, _workspace("gdot", (c, N1), cdt, dev))  # sum_R g y
        if ds is not None:
            ds += gdot.sum(0)
        # db = r (s g - y mean_R(s g y)) = (r s) g - (r s gdot / R) y
        rs = r * sc if sc is not None else r  # (c, N-1)
        torch.mul(g, rs.unsqueeze(-1), out=db)
        db.sub_(y.mul_((rs * gdot).div_(R).unsqueeze(-1)))
    else:
        if ds is not None:
            gb = _rowdot(g, P, _workspace("gdot", (c, N1), cdt, dev))
            ds += gb.sum(0) if Wc is None else torch.einsum("ckr,kr->k", g * P, Wc)  # sum g b
        if sc is not None:
            torch.mul(g, sc.unsqueeze(-1), out=db)
        else:
            db.copy_(g)
    return db


def lookup_backward(
    grad: Tensor,
    table: Tensor,
    idx: Tensor,
    W: Tensor | None,
    scales: Tensor | None,
    rstd: Tensor | None,
    chunk: int,
    need_table: bool,
    need_W: bool,
    need_scales: bool,
    out: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients (d table (N*V, R), dW (N-1, R), ds (N-1,)) from grad (M, N-1, R); see module doc.

    out: the forward's e (M, N-1, R). When it is in the compute dtype and every s_j > 0, the
    RMSNorm backward reads y = e / s from it (4 passes instead of 7); otherwise y is rebuilt
    from the recomputed products (bf16 outputs: the rounded e would cost accuracy).
    """
    M, N = idx.shape
    R = table.shape[1]
    cdt, dev = _compute_dtype(table.dtype), table.device
    d_table = torch.zeros(table.shape, dtype=cdt, device=dev) if need_table else None
    dW = torch.zeros(N - 1, R, dtype=cdt, device=dev) if (need_W and W is not None) else None
    ds = torch.zeros(N - 1, dtype=cdt, device=dev) if (need_scales and scales is not None) else None
    Wc = None if W is None else W.to(cdt)
    sc = None if scales is None else scales.to(cdt)
    use_out = out is not None and out.dtype == cdt and (sc is None or bool((sc > 0).all()))
    inv_s = None if sc is None else 1.0 / sc
    for a in range(0, M, chunk):
        b_ = min(M, a + chunk)
        c = b_ - a
        rows = _gather(table, idx[a:b_], cdt)  # (c, N, R)
        P = _workspace("P", (c, N - 1, R), cdt, dev)  # P_2..P_N
        _prefix_products(rows, P)
        g = grad[a:b_]  # (c, N-1, R)
        if g.dtype != cdt:
            g = _workspace("g", (c, N - 1, R), cdt, dev).copy_(g)
        db = _grad_b(g, P, Wc, sc, inv_s, rstd, out, a, b_, use_out, ds)  # (c, N-1, R)
        if Wc is not None:
            if dW is not None:
                tmp = _workspace("dot_tmp", (c, N - 1, R), cdt, dev)
                dW += torch.mul(db, P, out=tmp).sum(0)  # sum_t db P
            db.mul_(Wc)  # D: grad w.r.t. P_{j+2}
        if d_table is None:
            continue
        D = db
        GR = _workspace("GR", (c, N, R), cdt, dev)  # d rows
        Pv, Dv, rv, GRv = P.unbind(1), D.unbind(1), rows.unbind(1), GR.unbind(1)
        G = Dv[N - 2]  # grad w.r.t. P_N
        Gbuf = _workspace("G", (c, R), cdt, dev)
        for k in range(N, 2, -1):  # P_k = P_{k-1} rows_{k-1}
            torch.mul(G, Pv[k - 3], out=GRv[k - 1])
            G = torch.addcmul(Dv[k - 3], G, rv[k - 1], out=Gbuf)  # grad w.r.t. P_{k-1}
        torch.mul(G, rv[0], out=GRv[1])  # P_2 = rows_0 rows_1
        torch.mul(G, rv[1], out=GRv[0])
        d_table.index_add_(0, idx[a:b_].reshape(-1), GR.view(c * N, R))
    if d_table is not None and d_table.dtype != table.dtype:
        d_table = d_table.to(table.dtype)
    if dW is not None and W is not None:  # dW is made only when W is given
        dW = dW.to(W.dtype)
    if ds is not None and scales is not None:  # ds is made only when scales are given
        ds = ds.to(scales.dtype)
    return d_table, dW, ds


@contextmanager
def _single_threaded(device: torch.device) -> Iterator[None]:
    """Run the chunk loop with one intra-op thread (CPU), restoring the count afterwards.

    The loop issues ~700 small ops per fwd+bwd; with 2 threads each is an OpenMP region that
    waits for its second thread, and when that thread is descheduled (a shared machine) the op
    takes a scheduler slice: measured 4.9 s median vs 47 ms single-threaded under load, and
    the single-threaded minimum was lower too (28 vs 40 ms). torch.set_num_threads is ~0.1 us.
    """
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class FusedTNGramLookup(torch.autograd.Function):
    """apply(factors (N,V,R), idx (M,N), W (N-1,R)|None, scales (N-1,)|None, use_norm, eps, chunk)
    -> e (M, N-1, R). Gradients for factors, W and scales; idx is not differentiable."""

    @staticmethod
    def forward(
        ctx,
        factors: Tensor,
        idx: Tensor,
        W: Tensor | None,
        scales: Tensor | None,  # noqa: ANN001
        use_norm: bool,
        eps: float,
        chunk: int,
    ) -> Tensor:
        N, V, R = factors.shape
        table = factors.reshape(N * V, R)
        with _single_threaded(table.device):
            out, rstd = lookup_forward(table, idx, W, scales, use_norm, eps, chunk)
        # out is the returned tensor (kept alive downstream anyway): saving it costs no memory
        ctx.save_for_backward(factors, idx, W, scales, rstd, out)
        ctx.chunk = chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        factors, idx, W, scales, rstd, out = ctx.saved_tensors
        N, V, R = factors.shape
        need_f, _, need_W, need_s = ctx.needs_input_grad[:4]
        with _single_threaded(factors.device):
            d_table, dW, ds = lookup_backward(
                grad.contiguous(),
                factors.reshape(N * V, R),
                idx,
                W,
                scales,
                rstd,
                ctx.chunk,
                need_f,
                need_W,
                need_s,
                out,
            )
        d_f = None if d_table is None else d_table.view(N, V, R)
        return d_f, None, dW, ds, None, None, None


def plain_lookup(
    factors: Tensor,
    idx: Tensor,
    W: Tensor | None,
    scales: Tensor | None,
    use_norm: bool,
    eps: float,
    chunk: int = 0,
) -> Tensor:
    """The same e (M, N-1, R) with plain differentiable torch ops (autograd does the backward).

    What runs under torch.compile when the lookup resolves to the torch path: dynamo cannot
    trace the workspace cache and thread switching of `FusedTNGramLookup`, and Inductor fuses
    these few ops itself. Also the independent reference of the kernels' first-use self-check.
    chunk is ignored.
    """
    N, V, R = factors.shape
    cdt = _compute_dtype(factors.dtype)
    rows = factors.reshape(N * V, R)[idx].to(cdt)  # (M, N, R)
    prods, p = [], rows[:, 0]
    for k in range(1, N):  # not torch.cumprod: its backward divides by the inputs (less exact)
        p = p * rows[:, k]
        prods.append(p)
    P = torch.stack(prods, dim=1)  # (M, N-1, R) P_2..P_N
    b = P if W is None else P * W.to(cdt)  # Eq. 10
    if use_norm:
        b = b * torch.rsqrt(b.square().mean(-1, keepdim=True) + eps)
    if scales is not None:
        b = b * scales.to(cdt).unsqueeze(-1)  # Eq. 11
    return b.to(factors.dtype)

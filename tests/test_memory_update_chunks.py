"""LazyAdam / RowwiseAdam update the touched rows in chunks (tngram.optim.lazy_rows,
`_ROW_CHUNK_ELEMS`): the chunking is a memory-locality choice only, so several chunks (with a
partial last one) must give the same weights and state, bit for bit, as one chunk; and LazyAdam in
chunks still equals torch.optim.SparseAdam. clip_grad_norm with sparse gradients skips the scaling
pass when nothing is clipped: the gradients stay bitwise unchanged and the norm is the norm.
"""

from __future__ import annotations

import pytest
import torch

from tngram.kernels.sparse_rows import sparse_row_grad
from tngram.optim import lazy_rows
from tngram.optim.memory_update import LazyAdam, RowwiseAdam, clip_grad_norm

SHAPE = (3, 20, 6)          # TN-gram-like (N, V, R) table: 60 rows of width 6


def _sparse_grad(step: int) -> torch.Tensor:
    """A coalesced sparse gradient of SHAPE holding 11 distinct random rows (row 0 every step)."""
    g = torch.Generator().manual_seed(100 + step)
    n_rows = SHAPE[0] * SHAPE[1]
    rows = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(n_rows - 1, generator=g)[:10]])
    rows = rows.sort().values
    return sparse_row_grad(rows, torch.randn(rows.numel(), SHAPE[-1], generator=g), SHAPE)


def _run(make_opt, steps: int = 5) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(SHAPE))
    opt = make_opt([w])
    for t in range(steps):
        w.grad = _sparse_grad(t)
        opt.step()
    return w.detach().clone(), {k: (v.clone() if torch.is_tensor(v) else v)
                                for k, v in opt.state[w].items()}


@pytest.mark.parametrize("cls", [LazyAdam, RowwiseAdam])
def test_chunks_of_touched_rows_give_the_one_chunk_numbers(cls, monkeypatch):
    make = lambda p: cls(p, lr=0.05, betas=(0.9, 0.95), eps=1e-8)  # noqa: E731
    w_one, st_one = _run(make)                                      # 11 rows, one chunk
    monkeypatch.setattr(lazy_rows, "_ROW_CHUNK_ELEMS", 3 * SHAPE[-1])   # 3 rows per chunk
    w_chunks, st_chunks = _run(make)                                # chunks of 3, 3, 3, 2 rows
    assert torch.equal(w_chunks, w_one)
    assert st_chunks.keys() == st_one.keys()
    for k in st_one:
        assert (torch.equal(st_chunks[k], st_one[k]) if torch.is_tensor(st_one[k])
                else st_chunks[k] == st_one[k]), k
    torch.manual_seed(0)
    assert float((w_one - torch.randn(SHAPE)).abs().max()) > 0.1   # the touched rows did move


def test_lazy_adam_in_chunks_is_torch_sparse_adam(monkeypatch):
    monkeypatch.setattr(lazy_rows, "_ROW_CHUNK_ELEMS", 2 * SHAPE[-1])   # 2 rows per chunk
    kw = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8)
    got, _ = _run(lambda p: LazyAdam(p, **kw))
    ref, _ = _run(lambda p: torch.optim.SparseAdam(p, **kw))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_clip_without_clipping_leaves_sparse_and_dense_gradients_bitwise():
    torch.manual_seed(0)
    table, other = torch.nn.Parameter(torch.randn(SHAPE)), torch.nn.Parameter(torch.randn(4, 5))
    table.grad, other.grad = _sparse_grad(0), torch.randn(4, 5)
    before = (table.grad.values().clone(), other.grad.clone())
    expect = torch.cat([before[0].flatten(), before[1].flatten()]).norm()
    total = clip_grad_norm([table, other], max_norm=1e6)
    torch.testing.assert_close(total, expect, rtol=1e-6, atol=0)
    assert torch.equal(table.grad.values(), before[0]) and torch.equal(other.grad, before[1])
    clip_grad_norm([table, other], max_norm=float(expect) / 2)    # clipped: scaled to half
    torch.testing.assert_close(other.grad, before[1] / 2, rtol=1e-5, atol=0)

"""How many ops a row-sparse step of TN-gram's factor tables dispatches (research.bench.op_counts).

On a GPU in eager mode each computing aten op is a kernel launch: a row-sparse step must cost a
fixed, small number of them per memory table, whatever the factor count N, the number of rows
touched or the table's size. The counts below are derived op by op in comments; a per-factor
loop, a per-chunk loop off the CPU, or a pass over a whole table would raise them. The numbers
themselves (the compact layout, the sparse gradient's indices, the flat row ids) are checked
against independent computations, and the step reads nothing back to the host.
"""

from __future__ import annotations

import pytest
import torch
from test_sparse_rows_syncs import SYNCS

from research.bench.op_counts import OpCount, step_op_counts
from tngram.kernels.sparse_rows import compact_rows, sparse_row_grad
from tngram.optim.row_adams import LazyAdam, RowwiseAdam

# TN-gram's compaction of one factor table (N, V, R), any N (tngram.kernels.sparse_rows):
#   unique 1, searchsorted (block edges) 1, diff 1, max 1, item (U_b, the one host read) 1,
#   div (block of each row) 1, arange 1, edges[which] 1, sub_ 1, add_ (pos) 1, zeros 1,
#   index_put_ (src) 1, index_select (the gather) 1, pos[inv] 1                        = 14
COMPACT_FWD = 14
# its backward: index_select (values in uniq order) 1, sub (row within its factor) 1, stack
# (the (2, U) indices) 1, the sparse tensor 1, AccumulateGrad's clone of a sparse gradient 1 = 5
COMPACT_BWD = 5
# the table optimiser's step on one table, the torch path in one chunk:
#   flat row ids from the (2, U) indices: one add 1; gather m, v: index_select 2;
#   LazyAdam: m.mul_ add_ 2, v.mul_ addcmul_ 2, sqrt add_(eps) div mul_(-lr...) 4;
#   RowwiseAdam: m.mul_ add_ 2, square mean v.mul_ add_ 4, sqrt div add_(eps) 3, div mul_ 2;
#   scatter back: index_copy_ m, v 2, index_add_ w 1
STEP_OPS = {LazyAdam: 1 + 2 + 8 + 3, RowwiseAdam: 1 + 2 + 11 + 3}


def _syncs(c: OpCount) -> int:
    return sum(n * SYNCS[k] for k, n in c.ops.items() if k in SYNCS)


def _factor_ids(N: int, V: int, M: int, seed: int) -> torch.Tensor:
    """(M, N) flat row ids as ngram_row_index makes them: column k reads factor N-1-k."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (M, N), generator=g) + torch.arange(N - 1, -1, -1) * V


@pytest.mark.parametrize("N", [2, 5, 8])
def test_compaction_of_a_factor_table_costs_the_same_ops_for_any_n(N):
    V, R = 300, 8
    table = torch.randn(N, V, R, requires_grad=True)
    ids = _factor_ids(N, V, 200, N)
    compact_rows(table.detach(), ids, blocks=N)  # the block bounds are made once per shape
    fwd, bwd = OpCount(table.numel()), OpCount(table.numel())
    with fwd:
        sub, inv = compact_rows(table, ids, blocks=N, sparse=True)
    assert fwd.kernels() <= COMPACT_FWD, dict(fwd.ops)
    assert _syncs(fwd) == 2, dict(fwd.ops)  # the unique's size and U_b (test_sparse_rows_syncs)
    grad = torch.randn(sub.shape, generator=torch.Generator().manual_seed(1))
    with bwd:
        sub.backward(grad)
    assert bwd.kernels() <= COMPACT_BWD, dict(bwd.ops)
    assert (
        _syncs(bwd) == 0 and fwd.table_sized() == bwd.table_sized() == 0
    )  # nothing table-sized made
    # the numbers: each slot of sub that an id was sent to passes its gradient row to that
    # id's table row; the padding slots (never read) pass nothing
    g = table.grad
    assert g is not None and g.is_sparse and g.is_coalesced()
    dense = torch.zeros(N * V, R)
    row_of_slot = torch.empty(sub.shape[0], dtype=torch.long)
    row_of_slot[inv.flatten()] = ids.flatten()
    for s in torch.unique(inv).tolist():
        dense[row_of_slot[s]] += grad[s]
    assert torch.equal(g.to_dense().reshape(-1, R), dense)
    assert torch.equal(sub[inv], table.detach().reshape(-1, R)[ids])


@pytest.mark.parametrize("cls", [LazyAdam, RowwiseAdam])
def test_table_step_ops_off_the_cpu_do_not_grow_with_the_rows(cls):
    """On a non-CPU device (meta: shapes only, the path a GPU takes when the row kernel is not
    used) the torch row update is one chunk: the same ops for 30 rows as for 3000 rows of width
    1024 (which the CPU splits into 12 chunks of 256 rows). Control: the CPU does chunk them."""
    counts = {}
    for dev, n_rows in (("meta", 30), ("meta", 3000), ("cpu", 3000)):
        w = torch.nn.Parameter(torch.zeros(3, 2000, 1024, device=dev))
        rows = torch.arange(0, 2 * n_rows, 2, device=dev)  # half the rows at most
        opt = cls([w], lr=0.1)
        for _ in range(2):  # the first step allocates the state: count the second
            w.grad = sparse_row_grad(rows, torch.ones(n_rows, 1024, device=dev), w.shape)
            c = OpCount(w.numel())
            with c:
                opt.step()
        counts[dev, n_rows] = c.kernels()
        assert _syncs(c) == 0 and c.table_sized() == 0, (dev, dict(c.ops))
    assert counts["meta", 30] == counts["meta", 3000] <= STEP_OPS[cls], counts
    assert counts["cpu", 3000] > counts["meta", 3000]  # 12 chunks: the count would catch a loop


def test_tiny_paper_l9_step_op_counts():
    """The whole step of a two-memory-layer paper-l9 TN-gram (bench.op_counts): sparse adds at
    most the compaction's ops to the forward and its backward's to the backward, per layer, and
    makes nothing table-sized in any phase; dense zero-fills a gradient per table and runs Adam
    over it (the control that the count sees whole-table passes). cp_rank 256: a factor table
    (3 x 512 x 256 entries) is larger than any activation here (logits 128 x 512), so
    "table-sized" means a pass over a table. (rowwise differs from sparse only in the step:
    test_table_step_ops_off_the_cpu_do_not_grow_with_the_rows.)"""
    extra = ("model.memory.cp_rank=256", "model.memory.max_ngram=3")
    dense = step_op_counts("tngram", "dense", vocab=512, extra=extra)
    assert dense["backward"]["table_sized"] >= 2 and dense["step"]["table_sized"] >= 2
    got = step_op_counts("tngram", "sparse", vocab=512, extra=extra)
    assert got["forward"]["ops"] - dense["forward"]["ops"] <= 2 * COMPACT_FWD
    assert got["backward"]["ops"] - dense["backward"]["ops"] <= 2 * COMPACT_BWD
    assert all(got[p]["table_sized"] == 0 for p in ("forward", "backward", "step")), got
    assert got["step"]["by_op"]["index_add_"] == 2  # one row update per table, one chunk each

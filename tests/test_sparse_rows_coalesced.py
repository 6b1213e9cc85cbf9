"""A table's row-sparse gradient reaches the optimiser marked coalesced, so the optimiser does not
coalesce it again (tngram.kernels.sparse_rows: `_remark`).

torch's AccumulateGrad stores a parameter's first sparse gradient as a shallow copy without the
coalesced flag; the optimiser's `grad.coalesce()` would then sort the rows, copy every value and,
on CUDA, read the row count back to the host, per table per step. These tests run the path users
take (a module's forward and backward with no dispatch mode around it: a mode that holds a
reference to the gradient sends AccumulateGrad down its cloning path, which keeps the flag) and
check that the flag is never set on a gradient whose rows are not sorted and distinct.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_sparse_rows_syncs import SYNCS

from research.bench.op_counts import OpCount
from tngram.kernels.sparse_rows import accumulate_at_exit, sparse_row_grad
from tngram.memory.engram import EngramConfig
from tngram.memory.tngram import TNGramConfig
from tngram.optim.memory_update import set_sparse_grads
from tngram.optim.row_adams import LazyAdam, RowwiseAdam
from torch.utils._python_dispatch import TorchDispatchMode

from test_train_support import tiny_data  # noqa: F401


def _rows_sorted_and_distinct(g: torch.Tensor) -> bool:
    """Independent check of what the coalesced flag promises: flat row ids strictly increasing."""
    ind = g._indices()
    lead = g.shape[: ind.shape[0]]
    flat = torch.zeros(ind.shape[1], dtype=torch.long)
    for d in range(ind.shape[0]):
        flat = flat * lead[d] + ind[d]
    return bool((flat[1:] > flat[:-1]).all())


def _assert_truthful_and_dense(g, dense):  # noqa: ANN001
    """g is a sparse gradient whose coalesced flag, if set, is true, and whose rows summed are
    the dense gradient `dense`."""
    assert g is not None and g.is_sparse
    if g.is_coalesced():
        assert _rows_sorted_and_distinct(g)
    torch.testing.assert_close(g.coalesce().to_dense(), dense, rtol=1e-6, atol=1e-7)


def test_torch_drops_the_flag_of_a_first_sparse_gradient():
    """Why the hook exists: a Function returning a coalesced sparse gradient leaves p.grad
    marked uncoalesced (if torch stops doing this, `_remark` is no longer needed)."""
    p = torch.nn.Parameter(torch.zeros(3, 5, 4))
    rows, vals = torch.tensor([1, 6, 12]), torch.randn(3, 4)

    class Read(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # noqa: ANN001, ANN205
            return t.sum()

        @staticmethod
        def backward(ctx, go):  # noqa: ANN001, ANN205
            g = sparse_row_grad(rows, vals, (3, 5, 4))
            assert g.is_coalesced()
            return g

    Read.apply(p).backward()
    assert p.grad is not None and p.grad.is_sparse and not p.grad.is_coalesced()


def _tngram(seed: int = 0):
    torch.manual_seed(seed)
    cfg = TNGramConfig(max_ngram=4, cp_rank=16, fused=True)
    mod = cfg.make_module(d_model=32, vocab_size=300, layer_id=0, layer_ids=(0,))
    set_sparse_grads(mod, True)
    return mod, mod.factors


def _engram(seed: int = 0):
    torch.manual_seed(seed)
    cfg = EngramConfig(max_ngram=3, n_head_per_ngram=2, n_embed_per_ngram=32, table_budget=(97, 89))
    mod = cfg.make_module(d_model=32, vocab_size=300, layer_id=0, layer_ids=(0,))
    set_sparse_grads(mod, True)
    return mod, mod.table.weight


@pytest.mark.parametrize("make", [_tngram, _engram], ids=["tngram", "engram"])
@pytest.mark.parametrize("cls", [LazyAdam, RowwiseAdam])
def test_one_backward_reaches_the_optimiser_coalesced(make, cls, monkeypatch):
    """One forward + backward as the trainer runs it: the table's gradient is marked coalesced
    (and is: rows sorted and distinct), its values are the dense gradient's touched rows, and
    the optimiser's step coalesces nothing and reads nothing back (no sync op)."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    mod, table = make()
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    h = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(2))
    opt = cls([table], lr=0.01)
    for step in range(2):  # the first step allocates the optimiser's state: count the second
        mod(h, ids).square().mean().backward()
        g = table.grad
        assert g is not None and g.is_sparse and g.is_coalesced() and _rows_sorted_and_distinct(g)
        c = OpCount(table.numel())
        with c:
            opt.step()
        table.grad = None
        assert "_coalesce" not in c.ops and sum(SYNCS.get(k, 0) * n for k, n in c.ops.items()) == 0
    # the values: the same model with dense gradients
    dense_mod, dense_table = make()
    set_sparse_grads(dense_mod, False)
    sparse_mod, sparse_table = make()
    dense_mod(h, ids).square().mean().backward()
    sparse_mod(h, ids).square().mean().backward()
    assert torch.equal(sparse_table.grad.to_dense(), dense_table.grad)


@pytest.mark.parametrize("make", [_tngram, _engram], ids=["tngram", "engram"])
def test_accumulated_micro_steps_keep_a_truthful_flag(make, monkeypatch):
    """Three micro-steps accumulate into one gradient: whatever flag torch leaves it with is
    true (set only on sorted, distinct rows), and after coalescing its values are the sum of the
    dense gradients' rows."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    mod, table = make()
    dense_mod, dense_table = make()
    set_sparse_grads(dense_mod, False)
    for k in range(3):
        ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(10 + k))
        h = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(20 + k))
        mod(h, ids).square().mean().backward()
        dense_mod(h, ids).square().mean().backward()
    _assert_truthful_and_dense(table.grad, dense_table.grad)


def test_a_table_read_twice_in_one_step_is_not_marked_wrongly(monkeypatch):
    """Two reads of one table in one forward: autograd sums the two row-sparse gradients before
    they reach the table (a concatenation of their rows, duplicates included). The flag the
    table's gradient ends with is true, and its values are the dense gradient's."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    mod, table = _tngram()
    dense_mod, dense_table = _tngram()
    set_sparse_grads(dense_mod, False)
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    h = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(4))
    (mod(h, ids).square().mean() + mod(h.flip(1), ids.flip(1)).sum()).backward()
    (dense_mod(h, ids).square().mean() + dense_mod(h.flip(1), ids.flip(1)).sum()).backward()
    _assert_truthful_and_dense(table.grad, dense_table.grad)


class SparseAdds(TorchDispatchMode):
    """Counts the additions that take a sparse tensor (torch's accumulation of sparse grads)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket.__name__ in ("add", "add_") and any(
            isinstance(a, torch.Tensor) and a.is_sparse for a in args
        ):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _micro_steps(mod, k: int, deferred: bool) -> int:
    """k forward + backward passes of `mod` (inside accumulate_at_exit when `deferred`); the
    sparse additions they dispatched."""
    count = SparseAdds()
    with accumulate_at_exit() if deferred else contextlib.nullcontext():
        for i in range(k):
            ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(30 + i))
            h = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(40 + i))
            loss = mod(h, ids).square().mean()
            with count:
                loss.backward()
    return count.n


@pytest.mark.parametrize("make", [_tngram, _engram], ids=["tngram", "engram"])
@pytest.mark.parametrize("k", [1, 3])
def test_accumulate_at_exit_adds_the_micro_steps_up_once(make, k, monkeypatch):
    """Inside accumulate_at_exit the micro-steps' table gradients are not added one by one (no
    sparse addition during the backwards, p.grad cleared after each); on exit p.grad holds all
    their rows once (nnz = the micro-steps' nnz summed), and its coalesced values are the sum
    of the dense gradients (the same model with dense gradients, the same batches). One
    micro-step: its gradient as it was, marked coalesced."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    mod, table = make()
    dense_mod, dense_table = make()
    set_sparse_grads(dense_mod, False)
    each = []
    for i in range(k):  # each micro-step's own gradient, for its row count
        one, one_table = make()
        ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(30 + i))
        h = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(40 + i))
        one(h, ids).square().mean().backward()
        each.append(one_table.grad._nnz())
    assert _micro_steps(mod, k, deferred=True) == 0
    _micro_steps(dense_mod, k, deferred=False)
    g = table.grad
    assert g is not None and g.is_sparse and g._nnz() == sum(each)
    assert g.is_coalesced() == (k == 1)
    torch.testing.assert_close(g.coalesce().to_dense(), dense_table.grad, rtol=1e-6, atol=1e-7)
    # control: without it, torch adds each later micro-step's gradient to p.grad
    plain, _ = make()
    assert _micro_steps(plain, k, deferred=False) == k - 1


def test_the_trainer_adds_sparse_micro_steps_up_once(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    """The trainer's micro-steps run inside accumulate_at_exit: a TN-gram run with row-sparse
    tables and 2 micro-steps per step (tiny_config: 512 tokens a step, 4 x 64 a micro-step)
    dispatches no sparse addition (without it: one per table per step, the control above), and
    the optimiser gets one gradient per table, holding the rows of both micro-steps uncoalesced."""
    from test_train_support import tiny_config

    from tngram.train.loop import train

    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    cfg = tiny_config(
        tiny_data,
        "mini-tngram",
        ["optim.memory_update=sparse", "schedule.steps=1", "schedule.warmdown_steps=0",
         "run.checkpoint_every=0", "run.val_every=0"],
    )
    seen = []
    real = LazyAdam.step

    def step(self, closure=None):  # noqa: ANN001, ANN202
        seen.extend(p.grad for group in self.param_groups for p in group["params"])
        return real(self, closure)

    monkeypatch.setattr(LazyAdam, "step", step)
    adds = SparseAdds()
    with adds:
        train(cfg, tmp_path / "run")
    assert seen and adds.n == 0
    assert all(g is not None and g.is_sparse and not g.is_coalesced() for g in seen)


def test_a_dense_gradient_set_aside_is_added_to_the_sparse_ones():
    """_summed, the sum accumulate_at_exit makes: sparse gradients concatenated once, a dense one
    (a table also read without row-sparse gradients) added; the same as adding them densely."""
    from tngram.kernels.sparse_rows import _summed

    shape = (3, 5, 4)
    a = sparse_row_grad(torch.tensor([1, 6]), torch.randn(2, 4), shape)
    b = sparse_row_grad(torch.tensor([6, 12]), torch.randn(2, 4), shape)
    d = torch.randn(shape)
    got = _summed([a, d, b])
    assert not got.is_sparse
    torch.testing.assert_close(got, a.to_dense() + d + b.to_dense())
    both = _summed([a, b])
    assert both.is_sparse and both._nnz() == 4 and not both.is_coalesced()
    torch.testing.assert_close(both.to_dense(), a.to_dense() + b.to_dense())

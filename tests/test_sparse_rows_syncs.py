"""Row-sparse reads without avoidable host syncs (tngram.kernels.sparse_rows).

On CUDA an op whose result the host must see (a value read back, a tensor built from host data,
an output sized by the data) makes the host wait until the card has finished everything queued
before it. In TN-gram's row-sparse path these sat in the backward, where the host is far ahead
of the card: torch.unravel_index builds its divisors with torch.tensor(..., device=...), two
blocking host-to-device copies per table per step, and the forward's block layout counted rows
with bincount (which reads the input's min and max back). The replacements must give the same
indices and the same compact layout, and the step must hold only the syncs it needs: the
unique's size and the largest block's row count in the forward, none in the backward.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tngram.kernels.sparse_rows import compact_rows, unravel_rows
from tngram.memory.tngram import TNGramConfig
from tngram.optim.memory_update import set_sparse_grads

# aten ops that are a host sync on CUDA: a value read back (item), a tensor from host data (a
# blocking host-to-device copy), an output sized by the data; bincount reads min and max (2)
SYNCS = {
    "_local_scalar_dense": 1,
    "lift_fresh": 1,
    "_unique2": 1,
    "unique_dim": 1,
    "unique_consecutive": 1,
    "nonzero": 1,
    "bincount": 2,
    "_coalesce": 1,
    "masked_select": 1,
}


class SyncCount(TorchDispatchMode):
    """Counts the dispatched ops of SYNCS (weighted) by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in SYNCS:
            self.seen[name] += SYNCS[name]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lead", [(5, 7), (3, 4, 6), (1, 9), (4, 1), (2, 3, 1, 5)])
def test_unravel_rows_equals_torch_unravel_index(lead):
    n = 1
    for s in lead:
        n *= s
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(0)).sort().values
    want = torch.stack(torch.unravel_index(rows, lead))
    got = unravel_rows(rows, lead)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # with the first index given (the backward passes the forward's block ids): the same rows,
    # and the optimiser step's flat row ids invert them
    got = unravel_rows(rows, lead, first=want[0].clone())
    assert got.dtype == want.dtype and torch.equal(got, want)
    from tngram.optim.lazy_rows import _flat_rows

    assert torch.equal(_flat_rows(want, lead), rows)


def test_compact_rows_block_layout():
    """Every id of block j lands in block j of the compact table, whose blocks are U_b = the
    most distinct rows any block reads (counted here with Python sets), and reads its row."""
    N, V, W = 4, 50, 3
    table = torch.randn(N, V, W)
    g = torch.Generator().manual_seed(1)
    cols = [torch.randint(0, V // (k + 1), (40,), generator=g) + (N - 1 - k) * V for k in range(N)]
    ids = torch.stack(cols, dim=1)  # (40, N): column k in block N-1-k, fewer rows in later ones
    sub, inv = compact_rows(table, ids, blocks=N, sparse=True)
    per = max(len(set(c.tolist())) for c in cols)
    assert sub.shape == (N * per, W)
    assert torch.equal(sub[inv], table.reshape(-1, W)[ids])
    assert torch.equal(inv // per, ids // V)  # block kept


def _tngram_step_syncs() -> tuple[collections.Counter, collections.Counter]:
    torch.manual_seed(0)
    cfg = TNGramConfig(max_ngram=4, cp_rank=16, fused=True)
    mod = cfg.make_module(d_model=32, vocab_size=300, layer_id=0, layer_ids=(0,))
    set_sparse_grads(mod, True)
    ids = torch.randint(1, 300, (2, 24))
    h = torch.randn(2, 24, 32)
    fwd, bwd = SyncCount(), SyncCount()
    with fwd:
        loss = mod(h, ids).square().mean()
    with bwd:
        loss.backward()
    assert mod.factors.grad is not None and mod.factors.grad.is_sparse
    return fwd.seen, bwd.seen


def test_tngram_sparse_step_syncs_only_where_it_must(monkeypatch):
    """Forward: the unique's size and the largest block's row count, no bincount; the
    ids' range check (a CPU-only default, TNGRAM_CHECK_IDS) is switched off to count what CUDA
    runs. Backward: none (the C/Triton kernels and sparse_row_grad read nothing back)."""
    monkeypatch.setenv("TNGRAM_CHECK_IDS", "0")
    monkeypatch.setenv("TNGRAM_LOOKUP_IMPL", "c")
    from tngram.kernels import c_unavailable_reason

    if c_unavailable_reason():
        pytest.skip(f"C kernel unavailable: {c_unavailable_reason()}")
    fwd, bwd = _tngram_step_syncs()
    assert fwd == collections.Counter({"_unique2": 1, "_local_scalar_dense": 1}), fwd
    assert sum(bwd.values()) == 0, bwd

"""Row-sparse gradients for lookup tables: compact the touched rows, differentiate the compact copy.

A training step reads at most B*T*(rows per token) rows of an n-gram table or CP factor, yet the
usual backward (index_select / nn.Embedding / the fused lookups) zero-fills a gradient the size of
the whole table. `compact_rows` instead gathers the U distinct rows a batch touches into a small
(U', W) table (U' >= U: laid out in the table's blocks, see `compact_rows`), remaps the ids into
it, and gives the big table a sparse COO gradient holding exactly those U rows. The lookup
itself (torch, C or Triton, unchanged) runs on the compact table, so its backward zero-fills U'
rows instead of the table's:

    uniq, inv = unique(ids)                    sorted distinct row ids, inverse map
    sub       = table[uniq]   (U', W)          block-aligned; unused slots are never indexed
    lookup(sub, inv) -> out ; backward -> d sub (U', W) -> table.grad = sparse(uniq, d sub[pos])

The sparse gradient is coalesced (uniq is sorted and distinct); accumulated micro-steps add up
to an uncoalesced one, which the optimisers (torch.optim.SparseAdam, tngram.optim.memory_update)
coalesce. Its values equal the dense gradient's touched rows exactly (the same per-row sums in
the same order), so a sparse update can be checked against a dense computation.

torch's AccumulateGrad stores a parameter's first sparse gradient as a shallow copy made without
the coalesced flag (torch/csrc/autograd/functions/accumulate_grad.h), so `p.grad` would say
uncoalesced and the optimiser would coalesce it again: a sort, a copy of every value and, on
CUDA, a host sync, per table per step. A post-accumulate-grad hook on the table (`_remark`)
sets the flag again when `p.grad` is exactly the gradient this backward produced (the same
indices and values storage, held until the check, and the same row count); after a second
contribution (accumulated micro-steps, a table read twice) it is another tensor and stays as
torch left it.

Accumulated micro-steps (`accumulate_at_exit`, around the trainer's micro-steps). torch adds a
sparse gradient to `p.grad` by concatenating rows (on CUDA without merging them: ATen's
add_out_sparse_cuda), so k micro-steps copy the growing gradient k - 1 times: (k(k+1)/2 - 1)
micro-steps' worth of rows, 35 at k = 8. Inside `accumulate_at_exit()` the same hook sets each
accumulated gradient aside and clears `p.grad`, so the next micro-step's gradient is stored, not
added; on exit `p.grad` is their concatenation made once (k micro-steps' worth of rows; one
micro-step: its gradient, still marked coalesced). The optimiser coalesces it as before: the
rows and their sums are the same, the order of a row's additions the coalesce's own.

torch.compile: torch's own sparse embedding gradients do not compile (pytorch/pytorch#150656),
and neither would this Function. The compaction is therefore `torch.compiler.disable`d: dynamo
breaks the graph around it, the compiled graphs see `sub` as an ordinary dense input, and the
sparse gradient is produced in eager autograd (tests/test_memory_update.py compiles a model).

Tables of more than two dimensions (TN-gram's (N, V, R) factors) are treated as rows of their
last dimension: the gradient has len(shape) - 1 sparse dimensions and one dense dimension.

Tables kept on another device than the model (tngram.hf's table_device="cpu"): `host_read`
says a lookup must read through `compact_rows`, which then finds the distinct rows on the table's
device, gathers them there and moves only those U' rows (and the remapped ids) to the ids'
device; the gradient flows back through the move to the table's device, row-sparse with
sparse=True or dense (index_select's own backward) with sparse=False. Same values as a lookup
with the table beside the ids (the same rows, the same per-row sums in the same order).
`compact_reads()` takes that path with the table on the ids' device too (for tests).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

# id(table) -> hook(rows): called before compact_rows reads those rows of that table with gradients
# on (optim.memory_catchup brings the rows up to date first; tngram.optim.memory_update). Kept
# here, not on the parameter, so that a model still pickles and deep-copies as before.
_READ_HOOKS: dict[int, Callable[[Tensor], None]] = {}
_FORCE_COMPACT = [False]  # compact_reads(): host_read is True for every table


def host_read(table: Tensor, ids: Tensor) -> bool:
    """A lookup of `table` by `ids` must go through compact_rows: the table lives on another
    device (tngram.hf table_device), or compact_reads() is on."""
    return table.device != ids.device or _FORCE_COMPACT[0]


@contextlib.contextmanager
def compact_reads() -> Iterator[None]:
    """Inside: every table lookup reads through compact_rows, as a table on another device
    does (the path a one-device machine can test)."""
    old, _FORCE_COMPACT[0] = _FORCE_COMPACT[0], True
    try:
        yield
    finally:
        _FORCE_COMPACT[0] = old


def set_read_hook(table: Tensor, hook: Callable[[Tensor], None] | None) -> None:
    """Run `hook(rows)` (rows: sorted distinct flat row ids, under no_grad) each time
    `compact_rows` is about to read rows of `table` while gradients are on; None removes it.
    One hook per table; it goes with the table."""
    key = id(table)
    if hook is None:
        _READ_HOOKS.pop(key, None)
        return
    if key not in _READ_HOOKS:
        weakref.finalize(table, _READ_HOOKS.pop, key, None)
    _READ_HOOKS[key] = hook


class _CompactRows(torch.autograd.Function):
    """apply(table (..., W), uniq (U,) flat row ids, src (U',), pos (U,) or None, first (U,) or
    None) -> table.view(-1, W)[src] (row pos[i] of the result is row uniq[i] of the table; pos
    None: src is uniq, row i is row uniq[i]); backward: a sparse COO gradient of table's shape
    holding the U rows uniq. first: uniq's index along table's first dim, when known."""

    @staticmethod
    def forward(ctx, table, uniq, src, pos, first):  # noqa: ANN001, ANN205
        ctx.save_for_backward(uniq, pos, first)
        ctx.shape = table.shape
        ctx.key = _watch_accumulation(table)
        return table.reshape(-1, table.shape[-1]).index_select(0, src)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):  # noqa: ANN001, ANN205
        uniq, pos, first = ctx.saved_tensors
        # pos None: the gradient's rows are uniq's already (the copy index_select(0, arange)
        # would make); contiguous() only if autograd handed an expanded one
        vals = grad.contiguous() if pos is None else grad.index_select(0, pos)
        out = sparse_row_grad(uniq, vals, ctx.shape, first)
        if ctx.key is not None:  # checked by _remark once AccumulateGrad has stored it
            _FRESH[ctx.key] = (out._indices(), out._values())
        return out, None, None, None, None


# id(table) -> (indices, values) of the coalesced gradient its last backward produced, until the
# table's post-accumulate-grad hook (_remark) has compared p.grad with it; the strong references
# keep the storage from being reused by another tensor before the comparison
_FRESH: dict[int, tuple[Tensor, Tensor]] = {}
_WATCHED: set[int] = set()  # id(table) of the tables with the hook


def _watch_accumulation(table: Tensor) -> int | None:
    """Give a leaf table that requires grad the `_remark` hook (once); its key, else None."""
    if not (table.is_leaf and table.requires_grad):
        return None  # e.g. a cast of the parameter: its gradient reaches the leaf as a new tensor
    key = id(table)
    if key not in _WATCHED:
        _WATCHED.add(key)
        table.register_post_accumulate_grad_hook(_remark)
        weakref.finalize(table, _forget, key)
    return key


def _forget(key: int) -> None:
    _WATCHED.discard(key)
    _FRESH.pop(key, None)


def _remark(p: Tensor) -> None:
    """After AccumulateGrad: mark p.grad coalesced if it is the gradient `_CompactRows` just
    produced (module docstring), which was coalesced; inside `accumulate_at_exit`, then set
    p.grad aside."""
    fresh = _FRESH.pop(id(p), None)
    g = p.grad
    if g is None:
        return
    if fresh is not None and g.is_sparse and not g.is_coalesced():
        ind, vals = fresh
        if (
            g._nnz() == ind.shape[1]
            and g._indices().data_ptr() == ind.data_ptr()
            and g._values().data_ptr() == vals.data_ptr()
        ):
            g._coalesced_(True)
    if _DEFER[0]:
        _SET_ASIDE.setdefault(id(p), (weakref.ref(p), []))[1].append(g)
        p.grad = None


_DEFER = [False]  # accumulate_at_exit() is active
# id(table) -> (the table, the gradients set aside inside accumulate_at_exit(), in order)
_SET_ASIDE: dict[int, tuple[weakref.ref, list[Tensor]]] = {}


@contextlib.contextmanager
def accumulate_at_exit() -> Iterator[None]:
    """Inside: the gradients row-sparse tables accumulate are set aside; on exit each table's
    `p.grad` is their sum, made once (module docstring). Nested: the outer one does it."""
    if _DEFER[0]:
        yield
        return
    _DEFER[0] = True
    try:
        yield
    finally:
        _DEFER[0] = False
        aside = list(_SET_ASIDE.values())
        _SET_ASIDE.clear()
        for ref, grads in aside:
            p = ref()
            if p is not None:
                p.grad = _summed(grads if p.grad is None else [*grads, p.grad])


def _summed(grads: list[Tensor]) -> Tensor:
    """The sum of a table's gradients: the sparse ones concatenated once (uncoalesced unless
    there is one), the dense ones added to that."""
    sparse = [g for g in grads if g.is_sparse]
    out: Tensor | None = sparse[0] if len(sparse) == 1 else None
    if len(sparse) > 1:
        ind = torch.cat([g._indices() for g in sparse], 1)
        vals = torch.cat([g._values() for g in sparse], 0)
        with torch.sparse.check_sparse_tensor_invariants(enable=False):
            out = torch.sparse_coo_tensor(ind, vals, sparse[0].shape, is_coalesced=False)
    for g in grads:
        if not g.is_sparse:
            out = g if out is None else g + out
    assert out is not None  # grads is never empty
    return out


def sparse_row_grad(
    rows: Tensor,
    values: Tensor,
    shape: torch.Size | tuple[int, ...],
    first: Tensor | None = None,
) -> Tensor:
    """A sparse COO tensor of `shape` whose flat rows (over all but the last dim) `rows` hold
    `values` (len(rows), shape[-1]); `rows` must be sorted and distinct (it is marked coalesced).
    first: the rows' index along the first dim, when the caller has it (unravel_rows)."""
    lead = tuple(shape[:-1])
    idx = rows.unsqueeze(0) if len(lead) == 1 else unravel_rows(rows, lead, first)  # (len(lead), U)
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        return torch.sparse_coo_tensor(idx, values, tuple(shape), is_coalesced=True)


def unravel_rows(rows: Tensor, lead: tuple[int, ...], first: Tensor | None = None) -> Tensor:
    """torch.stack(torch.unravel_index(rows, lead)) (len(lead), U), with Python-int divisors.

    torch.unravel_index builds its divisors with torch.tensor(..., device=rows.device): on CUDA
    two blocking host-to-device copies, each a stream synchronisation, inside the backward
    (where the host is usually far ahead of the card). Integer floor division and remainder
    by Python ints are exact, so the indices are the same. first: rows // prod(lead[1:]) when
    the caller has it (the compaction's block of each row): the rest is then rows - first *
    prod(lead[1:]), one op instead of a division and a remainder (the same integers)."""
    out, rest = [], rows
    inner = lead[1:]
    if first is not None:
        rest = torch.sub(rows, first, alpha=math.prod(inner))
        inner = inner[1:]
    for size in reversed(inner):
        out.append(torch.remainder(rest, size))
        rest = torch.div(rest, size, rounding_mode="floor")
    out.append(rest)
    if first is not None:
        out.append(first)
    return torch.stack(out[::-1])


_COMPACT_ROWS_EAGER = None


def compact_rows(
    table: Tensor, ids: Tensor, blocks: int = 1, sparse: bool = True
) -> tuple[Tensor, Tensor]:
    """`_compact_rows` kept out of torch.compile graphs. The `torch.compiler.disable` wrapper is
    made on first use, not at import: it imports torch._dynamo (and its triton probe), which
    `import tngram.kernels` must not pay for."""
    global _COMPACT_ROWS_EAGER
    if _COMPACT_ROWS_EAGER is None:
        _COMPACT_ROWS_EAGER = torch.compiler.disable(_compact_rows)
    return _COMPACT_ROWS_EAGER(table, ids, blocks, sparse)


def _compact_rows(
    table: Tensor, ids: Tensor, blocks: int = 1, sparse: bool = True
) -> tuple[Tensor, Tensor]:
    """(sub (blocks * U_b, W), inv like ids) with sub[inv] == table.reshape(-1, W)[ids]; the
    gradient that reaches `table` through `sub` is sparse (the U distinct rows only).

    The table's rows are `blocks` equal blocks (TN-gram: one per factor A_1..A_N, each V rows);
    an id of block j is remapped into block j of `sub`, whose blocks hold U_b rows each (U_b = the
    largest number of distinct rows read in one block; unused slots repeat table row 0 and are
    never read), so a kernel that checks "column k reads block N-1-k" still can. Not traced by
    torch.compile (module docstring). sparse=False: the table's gradient is dense (index_select's
    backward). A table on another device than `ids`: the rows are found and gathered on the
    table's device, and sub and inv come back on the ids' device.
    """
    if table.device != ids.device:
        sub, inv = _compact_rows(table, ids.to(table.device), blocks, sparse)
        return sub.to(ids.device), inv.to(ids.device)
    W = table.shape[-1]
    n_rows = table.numel() // W
    block = n_rows // blocks
    uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)  # sorted: grouped by block
    hook = _READ_HOOKS.get(id(table)) if _READ_HOOKS else None
    if hook is not None and torch.is_grad_enabled():
        with torch.no_grad():
            hook(uniq)
    if blocks == 1:  # sub is table[uniq]: row i of sub is uniq[i] (no position map)
        return _gather(table, uniq, uniq, None, None, sparse), inv
    # uniq is sorted: block j's rows are uniq[edges[j]:edges[j+1]] (searchsorted, not bincount,
    # whose CUDA kernel reads the input's min and max back to the host: two more syncs)
    edges = torch.searchsorted(uniq, _block_bounds(blocks, block, uniq))  # (blocks + 1,)
    per = max(1, int(edges.diff().max())) if uniq.numel() else 1  # U_b (the one host read here)
    which = torch.div(uniq, block, rounding_mode="floor")  # block of each row
    # row i of uniq (block j = which[i]) goes to j * per + its rank in the block, i - edges[j]
    pos = torch.arange(uniq.numel(), device=ids.device).sub_(edges[which]).add_(which, alpha=per)
    src = torch.zeros(blocks * per, dtype=uniq.dtype, device=ids.device)
    src[pos] = uniq
    first = which if table.dim() >= 3 and table.shape[0] == blocks else None  # its 1st index
    return _gather(table, uniq, src, pos, first, sparse), pos[inv]


def _block_bounds(blocks: int, block: int, like: Tensor) -> Tensor:
    """(blocks + 1,) first flat row of each block and the end, cached per shape and device (a
    fresh arange and product each call are two more kernels)."""
    key = (blocks, block, like.device, like.dtype)
    got = _BOUNDS.get(key)
    if got is None:
        got = _BOUNDS[key] = torch.arange(blocks + 1, device=like.device, dtype=like.dtype) * block
    return got


_BOUNDS: dict[tuple, Tensor] = {}


def _gather(
    table: Tensor,
    uniq: Tensor,
    src: Tensor,
    pos: Tensor | None,
    first: Tensor | None,
    sparse: bool,
) -> Tensor:
    """table.view(-1, W)[src]; the table's gradient row-sparse (sparse) or dense."""
    if sparse:
        return _CompactRows.apply(table, uniq, src, pos, first)
    return table.reshape(-1, table.shape[-1]).index_select(0, src)


__all__ = [
    "accumulate_at_exit",
    "compact_reads",
    "compact_rows",
    "host_read",
    "set_read_hook",
    "sparse_row_grad",
]

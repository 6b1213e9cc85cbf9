"""What the token-indexed memories (product keys, STEM, per-layer embeddings) share: the check of
their forward's inputs and their row reads.

`check_inputs(what, h, input_ids, d_model, vocab_size)` raises one TngramError line unless h is
(B, T, d_model) with input_ids (B, T), and checks the ids (tngram.memory.ngrams:
check_ids_in_forward).

`gather_rows(table, ids, sparse)` reads table[ids] (any ids shape, rows of width W); with
sparse=True and gradients on, the table's gradient is row-sparse (tngram.kernels.sparse_rows:
only the distinct rows read), with the same values as the dense gradient's touched rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tngram.common import TngramError
from tngram.kernels.sparse_rows import compact_rows, host_read
from tngram.memory.ngrams import check_ids_in_forward


def check_inputs(what: str, h: Tensor, input_ids: Tensor, d_model: int, vocab_size: int) -> None:
    """h (B, T, d_model), input_ids (B, T) integer in [0, vocab_size), or one line naming `what`."""
    if h.dim() != 3 or h.shape[:2] != input_ids.shape or h.shape[-1] != d_model:
        raise TngramError(
            f"{what} expects h of shape (B, T, {d_model}) matching input_ids (B, T); "
            f"got h {tuple(h.shape)} and input_ids {tuple(input_ids.shape)}"
        )
    check_ids_in_forward(input_ids, vocab_size)


def gather_rows(table: Tensor, ids: Tensor, sparse: bool) -> Tensor:
    """table (R, W), ids (...) int64 in [0, R) -> (..., W) on the ids' device (a table kept on
    another device is read through its touched rows: tngram.kernels.sparse_rows.host_read)."""
    flat = ids.reshape(-1)
    sparse = sparse and torch.is_grad_enabled()
    if sparse or host_read(table, flat):
        sub, inv = compact_rows(table, flat, sparse=sparse)  # (U, W), (n,)
        rows = torch.index_select(sub, 0, inv)
    else:
        rows = torch.index_select(table, 0, flat)  # (n, W)
    return rows.view(*ids.shape, table.shape[-1])

"""Row reads shared by the token-indexed memories (product keys, STEM, per-layer embeddings).

`gather_rows(table, ids, sparse)` reads table[ids] (any ids shape, rows of width W); with
sparse=True and gradients on, the table's gradient is row-sparse (tngram.kernels.sparse_rows:
only the distinct rows read), with the same values as the dense gradient's touched rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tngram.kernels.sparse_rows import compact_rows


def gather_rows(table: Tensor, ids: Tensor, sparse: bool) -> Tensor:
    """table (R, W), ids (...) int64 in [0, R) -> (..., W)."""
    flat = ids.reshape(-1)
    if sparse and torch.is_grad_enabled():
        sub, inv = compact_rows(table, flat)  # (U, W), (n,)
        rows = torch.index_select(sub, 0, inv)
    else:
        rows = torch.index_select(table, 0, flat)  # (n, W)
    return rows.view(*ids.shape, table.shape[-1])

"""Suffix n-gram windows (paper §3.1; Engram reference §2.1).

At position t the order-n context is (x_{t-n+1}, ..., x_t). Positions before the start of the
sequence hold `pad_id` (left padding). Nothing here ever reads a future token.

Dimension letters: B batch, T time, N maximum n-gram order.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from tngram.common import TngramError


def check_token_ids(ids: Tensor, vocab_size: int, what: str = "input_ids") -> None:
    """Raise one clear error when ids are not integers in [0, vocab_size)."""
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TngramError(f"{what} must be an integer tensor, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise TngramError(
            f"{what} must lie in [0, {vocab_size}) (the vocabulary size); got min {lo}, max {hi}"
        )


def ids_checked_in_forward(ids: Tensor) -> bool:
    """Whether model/memory forwards validate token ids (reading them: min/max).

    Never while torch.compile traces (a data-dependent value breaks the graph). Otherwise
    TNGRAM_CHECK_IDS decides: "1" always, "0" never, "auto" (default) only for CPU tensors,
    where reading the ids costs microseconds and no device sync; on a GPU the read would stall
    the host every step, so there the entry points check instead: the data loader (every
    shard against the vocabulary), `generate` (the prompt), and `check_token_ids` for callers
    feeding their own ids. Out-of-range ids on a GPU without the check fail inside the gather
    (a device-side assert), never silently.
    """
    if torch.compiler.is_compiling():
        return False
    mode = os.environ.get("TNGRAM_CHECK_IDS", "auto")
    if mode == "1":
        return True
    if mode == "0":
        return False
    return ids.device.type == "cpu"


def check_ids_in_forward(ids: Tensor, vocab_size: int, what: str = "input_ids") -> None:
    """The forwards' check: the dtype always (no data read), the range when
    `ids_checked_in_forward` (same error as `check_token_ids`)."""
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TngramError(f"{what} must be an integer tensor, got dtype {ids.dtype}")
    if ids_checked_in_forward(ids):
        check_token_ids(ids, vocab_size, what)


def suffix_ngrams(ids: Tensor, n_max: int, pad_id: int) -> Tensor:
    """Shifted copies of the sequence: out[b, t, k] = ids[b, t-k], or pad_id when t-k < 0.

    ids: (B, T) integer -> (B, T, n_max) int64. Column k = 0 is the current token (newest),
    column k = n_max-1 the oldest; the order-n context at t is out[b, t, :n] read right to left.
    """
    if n_max < 1:
        raise TngramError(f"n_max must be >= 1, got {n_max}")
    B, T = ids.shape
    ids = ids.long()
    padded = torch.cat([ids.new_full((B, n_max - 1), pad_id), ids], dim=1)  # (B, T + n_max - 1)
    # column k = shift by k: padded[:, n_max-1-k : n_max-1-k+T]
    cols = [padded[:, n_max - 1 - k : n_max - 1 - k + T] for k in range(n_max)]
    return torch.stack(cols, dim=-1)  # (B, T, n_max)


def extend_with_history(
    ids: Tensor, cache: dict | None, n_max: int, pad_id: int, valid: Tensor | None = None
) -> tuple[Tensor, int]:
    """Incremental decoding: prepend the previous n_max-1 token ids kept in `cache["ids"]`
    (pad_id before the sequence start) and store the new tail there.

    Returns (ids_ext, P): ids_ext (B, P + T); the outputs of the first P positions are dropped
    by the caller. Because the history is pad_id at the start, the n-grams of the new positions
    equal those of a full forward over the whole sequence. cache None: (ids, 0) unchanged.

    valid: optional (B, T) bool mask (False = a padding position, e.g. left padding in a batch):
    those ids are replaced by pad_id, so a left-padded row sees exactly the windows it would see
    alone. cache["keep_history"] = True keeps every id seen (not only the last n_max-1), so the
    history can be cut back to any length (tngram.hf uses it for cache cropping).
    """
    if valid is not None:
        ids = ids.long().masked_fill(~valid.bool(), pad_id)
    if cache is None:
        return ids, 0
    P, T, hist = n_max - 1, ids.shape[1], cache.get("ids")
    seen = ids if hist is None else torch.cat([hist.to(ids.dtype), ids], dim=1)
    cache["ids"] = seen if cache.get("keep_history") else seen[:, max(0, seen.shape[1] - P) :]
    ext = seen[:, max(0, seen.shape[1] - P - T) :]  # pad_id before the start
    return F.pad(ext, (P + T - ext.shape[1], 0), value=pad_id), P
